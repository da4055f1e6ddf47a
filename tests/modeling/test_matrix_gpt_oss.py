"""gpt-oss through the model matrix's engine checks (integration tier): the torch trainer's export equals the
checkpoint, and a perturbed trainer's weights committed into vLLM's CPU engine are served with the trainer's
log-probs (vLLM's gpt-oss loader writes the experts and sinks past the weight loaders its layerwise reload counts;
rollout_service/reload_routing.py routes them through). One engine."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest
import torch

from modeling.families import init_family

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "model_matrix.py"


@pytest.fixture(scope="module")
def matrix():
    spec = importlib.util.spec_from_file_location("model_matrix", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpt_oss_export_equals_its_checkpoint_tensor_for_tensor(tmp_path):
    from safetensors.torch import load_file

    from protos.config import TrainerConfig
    from trainer_service.torch_backend import TorchBackend

    model = init_family("gpt_oss", tmp_path / "gpt_oss")
    on_disk = load_file(model / "model.safetensors")
    exported = dict(TorchBackend(str(model), TrainerConfig()).export_hf_weights())
    assert sorted(exported) == sorted(on_disk)
    for name, tensor in on_disk.items():  # fused gate_up (interleaved), biases, sinks: the layout vLLM loads
        assert torch.equal(exported[name], tensor), name


def test_gpt_oss_serves_a_weight_update_with_the_trainers_logprobs(matrix, tmp_path):
    model = str(init_family("gpt_oss", tmp_path / "gpt_oss"))
    results: dict = {}
    asyncio.run(matrix.engine_checks(model, results))
    assert {name: check["status"] for name, check in results.items()} == {
        "serve": "pass",
        "logprobs": "pass",
        "update": "pass",
    }, results
