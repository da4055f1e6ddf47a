"""Kernel scratch (Marlin's lock arrays) stays on the memory CUDA graphs captured when a reload allocates anew."""

from __future__ import annotations

import logging

import pytest
import torch

from rollout_service.kernel_scratch import kept_across_reload

pytestmark = pytest.mark.unit


class MarlinLayer(torch.nn.Module):
    def __init__(self, size: int = 8):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4, 4))
        self.workspace = torch.zeros(size, dtype=torch.int32)  # a plain attribute, as vLLM's Marlin methods set it

    def process_weights_after_loading(self, size: int = 8):
        self.workspace = torch.zeros(size, dtype=torch.int32)  # what every reload does in vLLM


def test_a_reloads_new_workspace_is_replaced_by_the_captured_one_zeroed():
    model = torch.nn.Sequential(MarlinLayer(), MarlinLayer())
    captured = [layer.workspace for layer in model]
    captured[0][3] = 7  # whatever a kernel left (it leaves zeros; the restore zeroes anyway)
    with kept_across_reload(model):
        for layer in model:
            layer.process_weights_after_loading()
    assert all(layer.workspace is old for layer, old in zip(model, captured, strict=True))
    assert int(captured[0].abs().sum()) == 0


def test_a_workspace_of_another_shape_is_left_as_made_with_a_warning(caplog):
    model = torch.nn.Sequential(MarlinLayer())
    captured = model[0].workspace
    with caplog.at_level(logging.WARNING), kept_across_reload(model):
        model[0].process_weights_after_loading(size=16)
    assert model[0].workspace is not captured and model[0].workspace.shape == (16,)
    assert "kernel scratch changed shape in a reload (MarlinLayer.workspace)" in caplog.text


def test_models_without_scratch_and_unchanged_scratch_are_untouched():
    plain = torch.nn.Linear(4, 4)
    with kept_across_reload(plain):
        pass
    layer = MarlinLayer()
    same = layer.workspace
    with kept_across_reload(layer):
        pass
    assert layer.workspace is same


def test_a_workspace_that_is_not_a_fresh_lock_array_is_left_alone():
    layer = MarlinLayer()
    captured = layer.workspace
    with kept_across_reload(layer):
        layer.workspace = torch.arange(8, dtype=torch.int32)  # another kernel's state (a comm buffer), not locks
    assert layer.workspace is not captured and int(layer.workspace[7]) == 7
