"""vLLM's "Failed to load weights" after a reload is dropped only for layers that hold nothing a checkpoint carries."""

from __future__ import annotations

import logging

import pytest
import torch

from rollout_service.reload_notices import LAYERWISE_LOGGER, derived_buffer_classes, quiet_derived_buffer_warnings

pytestmark = pytest.mark.unit


def rotary():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):  # vLLM's custom ops read the current config when built
        return get_rope(16, max_position=64, is_neox_style=True, rope_parameters={"rope_theta": 10000.0})


class Stats(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(4))  # persistent: checkpoints carry it


def model_with_rotary():
    return torch.nn.ModuleDict({"rope": rotary(), "proj": torch.nn.Linear(4, 4), "stats": Stats()})


def test_vllms_rotary_embedding_holds_only_derived_buffers_and_linear_layers_do_not():
    names = derived_buffer_classes(model_with_rotary())
    assert type(rotary()).__name__ in names
    assert "Linear" not in names and "Stats" not in names and "ModuleDict" not in names


def test_a_class_with_one_loadable_layer_keeps_its_warning():
    class Mixed(torch.nn.Module):
        def __init__(self, loadable: bool):
            super().__init__()
            self.register_buffer("cache", torch.zeros(2), persistent=loadable)

    model = torch.nn.Sequential(Mixed(False), Mixed(True))
    assert "Mixed" not in derived_buffer_classes(model)
    assert "Mixed" in derived_buffer_classes(torch.nn.Sequential(Mixed(False)))


def test_the_warning_is_dropped_for_rotary_and_kept_for_a_layer_with_weights(caplog):
    from vllm.model_executor.model_loader.reload import layerwise

    assert layerwise.logger.name == LAYERWISE_LOGGER  # the logger the filter sits on is the one vLLM warns through
    model = model_with_rotary()
    rope_class = type(model["rope"]).__name__
    with caplog.at_level(logging.WARNING, logger=LAYERWISE_LOGGER):
        with quiet_derived_buffer_warnings(model) as notices:
            layerwise.logger.warning("%s: Failed to load weights", rope_class)
            layerwise.logger.warning("%s: Failed to load weights", "Linear")
        layerwise.logger.warning("%s: Failed to load weights", rope_class)  # after the reload: the filter is gone
    messages = [r.getMessage() for r in caplog.records if r.name == LAYERWISE_LOGGER]
    assert messages == ["Linear: Failed to load weights", f"{rope_class}: Failed to load weights"]
    assert notices.dropped == 1
