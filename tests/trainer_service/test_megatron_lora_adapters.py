"""Adapter-only export of the Megatron backend: PEFT names, shapes and vLLM's scale (trainer.lora.sync='adapters').

As test_lora_adapter_export.py for the torch backend: ``W + alpha / rank * B @ A`` of every exported adapter must
equal the merged export of the same policy. The tiny Qwen3-MoE and Beam, CPU, gloo world size 1, with
normalize_moe_lora: grouped expert adapters (the default) and megatron-bridge's per-expert ones
(``moe_grouped_lora=false``); the attention and dense-MLP adapters are the bridge's in both.
"""

from __future__ import annotations

import pytest
import torch
from lora_cases import MODELS, make_model_dir
from test_lora_adapter_export import ALPHA, RANK, merged_from_adapters

from protos.config import LoraConfig, MegatronConfig, TrainerConfig
from trainer_service import lora

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", params=MODELS)
def model_dir(request, tmp_path_factory):
    return make_model_dir(request.param, tmp_path_factory)


def _megatron(model_dir: str, grouped_lora: bool = True):
    from trainer_service.megatron.backend import MegatronBackend

    config = TrainerConfig(
        backend="megatron",
        geo_mask=None,
        megatron=MegatronConfig(moe_grouped_lora=grouped_lora),
        lora=LoraConfig(rank=RANK, alpha=ALPHA, normalize_moe_lora=True, sync="adapters"),
    )
    backend = MegatronBackend(model_dir, config)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():  # non-zero B everywhere (it starts at zero): every adapter moves its layer
        for name, parameter in backend.model[0].named_parameters():
            if name.endswith(("linear_out.weight", "lora_b")):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return backend


@pytest.mark.parametrize("grouped_lora", [True, False], ids=["grouped", "per-expert"])
def test_megatron_adapters_rebuild_the_merged_export_at_vllms_scale(model_dir, grouped_lora):
    from safetensors.torch import load_file

    backend = _megatron(model_dir, grouped_lora)
    base = load_file(f"{model_dir}/model.safetensors")
    record = backend.adapter_record()
    adapters = dict(backend.export_adapter_weights())
    merged = dict(backend.export_hf_weights())

    rebuilt = merged_from_adapters(base, adapters, record)
    assert rebuilt.keys() == {name for name in merged if lora.target_of(name) is not None}
    for name, weight in rebuilt.items():
        torch.testing.assert_close(weight, merged[name], rtol=1e-5, atol=1e-6, msg=name)
    top_k = backend.bridge.hf_pretrained.config.num_experts_per_tok
    assert record.expert_rank == RANK // top_k
    expert_a = [tensor for name, tensor in adapters.items() if ".mlp.experts." in name and ".lora_A." in name]
    assert expert_a and {tensor.shape[0] for tensor in expert_a} == {RANK // top_k}


def test_megatron_adapters_gather_over_expert_and_pipeline_ranks(tmp_path_factory):
    """EP=2 (each rank holds half the experts' adapters) and PP=2 (each stage half the layers) on two gloo ranks:
    every rank exports every adapter, and they rebuild the merged export (adapter_export_worker.py)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    beam_dir = make_model_dir("beam", tmp_path_factory)
    out = tmp_path_factory.mktemp("multirank") / "figures.json"
    worker = Path(__file__).with_name("adapter_export_worker.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    run = subprocess.run(
        [*command, str(worker), beam_dir, str(out)],
        cwd=worker.parent,
        # This checkout's packages first: the venv may also know another checkout of the project.
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(worker.parents[2])},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    figures = json.loads(out.read_text())
    for layout in ("ep2", "pp2"):
        result = figures[layout]
        assert result["names_match"] and result["same_on_every_rank"], (layout, result)
        assert result["max_abs_diff"] < 1e-6 and result["expert_rank"] == RANK // 4, (layout, result)
    assert figures["ep2"]["num_adapter_tensors"] == figures["pp2"]["num_adapter_tensors"]
