"""Adapter-only export (trainer.lora.sync='adapters'): PEFT names, shapes and vLLM's scale, both backends.

The reference is the merged export: for every adapted HF module, ``W + alpha / rank * B @ A`` from the exported
adapter (vLLM's arithmetic: one scale for all modules) must equal the merged weight the trainer publishes with
``sync='merged'``. Torch backend on the tiny Qwen3-MoE (fused expert tensors) and the tiny Beam (per-expert
modules), both with normalize_moe_lora (expert rank = rank / top_k); the Megatron backend (bridge adapters on
attention and dense MLP, grouped expert adapters) in test_megatron_lora_adapters.py.
"""

from __future__ import annotations

import pytest
import torch
from lora_cases import ALL_TARGETS, MODELS, make_model_dir

from protos.config import LoraConfig, TrainerConfig
from trainer_service import lora
from trainer_service.torch_backend import TorchBackend

pytestmark = pytest.mark.unit

RANK, ALPHA = 8, 16.0


@pytest.fixture(scope="module", params=MODELS)
def model_dir(request, tmp_path_factory):
    return make_model_dir(request.param, tmp_path_factory)


def adapter_config(normalize: bool = True) -> TrainerConfig:
    return TrainerConfig(
        geo_mask=None,
        lora=LoraConfig(rank=RANK, alpha=ALPHA, normalize_moe_lora=normalize, sync="adapters"),
    )


def randomize_adapters(backend: TorchBackend, seed: int = 3) -> None:
    """Non-zero B everywhere, so every adapter moves its layer (B starts at zero)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in backend.model.named_parameters():
            if name.endswith("lora_B"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)


def merged_from_adapters(base: dict, adapters: dict, record) -> dict[str, torch.Tensor]:
    """vLLM's view of base + adapter: every adapted module's ``W + alpha / rank * B @ A``."""
    scale = record.alpha / record.rank
    merged = {}
    for name in adapters:
        if name.endswith(".lora_A.weight"):
            module = name.removeprefix(lora.PEFT_PREFIX).removesuffix(".lora_A.weight")
            lora_b = adapters[name.replace(".lora_A.", ".lora_B.")]
            weight = base[f"{module}.weight"]
            merged[f"{module}.weight"] = weight + scale * (lora_b @ adapters[name])
    return merged


def test_adapters_in_peft_names_rebuild_the_merged_weights_at_vllms_scale(model_dir):
    backend = TorchBackend(model_dir, adapter_config())
    randomize_adapters(backend)
    base = dict(TorchBackend(model_dir, TrainerConfig()).export_hf_weights())
    record = backend.adapter_record()
    adapters = dict(backend.export_adapter_weights())
    merged = dict(backend.export_hf_weights())  # the sync='merged' publish of the same policy

    assert all(name.startswith(lora.PEFT_PREFIX) for name in adapters)
    rebuilt = merged_from_adapters(base, adapters, record)
    adapted = {name for name in merged if lora.target_of(name) is not None}
    assert rebuilt.keys() == adapted  # every adapted HF weight, per expert and projection
    for name, weight in rebuilt.items():
        torch.testing.assert_close(weight, merged[name], rtol=1e-5, atol=1e-6, msg=name)
    assert record.rank == RANK and record.alpha == ALPHA
    assert record.target_modules == [m for target in ALL_TARGETS for m in lora.HF_MODULES[target]]


def trainer_expert_b(backend: TorchBackend, layer_module: str, expert: int) -> torch.Tensor:
    """The trainer's own B of one expert's gate_proj (per-expert module, or its slice of the fused tensor)."""
    experts = backend.model.get_submodule(layer_module)
    if hasattr(experts, "parametrizations"):  # fused [E, 2I, H]: gate rows first
        lora_b = experts.parametrizations["gate_up_proj"][0].lora_B[expert]
        return lora_b[: lora_b.shape[0] // 2]
    return experts[expert].gate_proj.parametrizations["weight"][0].lora_B


def test_expert_adapters_keep_their_rank_and_carry_their_scale_in_b(model_dir):
    backend = TorchBackend(model_dir, adapter_config())
    top_k = backend.model.config.num_experts_per_tok
    assert backend.adapter_record().expert_rank == RANK // top_k
    randomize_adapters(backend)
    adapters = dict(backend.export_adapter_weights())
    experts = [name for name in adapters if ".mlp.experts." in name]
    dense = [name for name in adapters if ".mlp.experts." not in name]
    assert experts and dense
    assert {adapters[name].shape[0] for name in experts if ".lora_A." in name} == {RANK // top_k}
    assert {adapters[name].shape[-1] for name in experts if ".lora_B." in name} == {RANK // top_k}
    assert {adapters[name].shape[0] for name in dense if ".lora_A." in name} == {RANK}
    # vLLM scales every module by alpha / rank; the trainer scales experts by alpha / (rank / top_k): the
    # exported expert B is the trainer's times top_k (exact: a power of two).
    name = next(n for n in experts if n.endswith("experts.1.gate_proj.lora_B.weight"))
    layer_module = name.removeprefix(lora.PEFT_PREFIX).removesuffix(".1.gate_proj.lora_B.weight")
    assert torch.equal(adapters[name], trainer_expert_b(backend, layer_module, 1) * top_k)


def test_attention_only_adapters_name_only_attention_modules(model_dir):
    config = TrainerConfig(
        geo_mask=None,
        lora=LoraConfig(rank=RANK, alpha=ALPHA, target_modules=["linear_qkv", "linear_proj"], sync="adapters"),
    )
    backend = TorchBackend(model_dir, config)
    adapters = dict(backend.export_adapter_weights())
    modules = {name.removesuffix(".lora_A.weight").rpartition(".")[2] for name in adapters if ".lora_A." in name}
    assert modules == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert backend.adapter_record().expert_rank == 0
    assert backend.adapter_record().target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]


def test_sync_adapters_needs_lora_on():
    with pytest.raises(ValueError, match="trainer.lora.sync='adapters' needs trainer.lora.rank > 0"):
        LoraConfig(rank=0, sync="adapters")
