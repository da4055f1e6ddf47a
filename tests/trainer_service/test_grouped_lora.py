"""Grouped LoRA on the experts (trainer_service/megatron/grouped_lora.py) against megatron-bridge's per-expert
adapters on SequentialMLP experts, CPU fp32, the tiny Qwen3-MoE and the tiny Beam.

Both models are built from one checkpoint with the same adapters (the per-expert ones, B made non-zero, copied
into the grouped tensors): log-probs, the merged export, and a step's loss, grad norm and adapter gradients
agree. ``normalize_moe_lora`` gives the experts rank / top_k in both Megatron layouts and the torch backend.
Checkpoint round trips of grouped adapters: test_megatron_lora.py (grouped experts are the default).
"""

from __future__ import annotations

import pytest
import torch
from grouped_cases import assert_close, backend, gradients, parameters, sequential_names
from lora_cases import ALL_TARGETS, MODELS, lora_batch, make_model_dir

from protos.config import LoraConfig

pytestmark = pytest.mark.integration

RANK = 8  # normalized: 4 on the tiny Qwen3-MoE (top-2), 2 on the tiny Beam (top-4)


@pytest.fixture(scope="module", params=MODELS)
def model_dir(request, tmp_path_factory):
    return make_model_dir(request.param, tmp_path_factory)


def _lora(normalize: bool = True) -> LoraConfig:
    return LoraConfig(rank=RANK, alpha=16, target_modules=ALL_TARGETS, normalize_moe_lora=normalize)


def _same_adapters(grouped, sequential) -> dict[str, torch.Tensor]:
    """Give the per-expert model's adapters a non-zero B, copy every adapter into the grouped model."""
    generator = torch.Generator().manual_seed(0)
    per_expert = {name: p for name, p in parameters(sequential).items() if p.requires_grad}
    in_grouped = sequential_names({name: p.detach() for name, p in parameters(grouped).items() if p.requires_grad})
    assert in_grouped.keys() == per_expert.keys()
    with torch.no_grad():
        for name, adapter in per_expert.items():
            if name.endswith("linear_out.weight"):
                adapter.copy_(0.1 * torch.randn(adapter.shape, generator=generator))
            in_grouped[name].copy_(adapter)
    return per_expert


def test_grouped_lora_matches_per_expert_adapters_forward_backward_and_merged_export(model_dir):
    from trainer_service.megatron.grouped_lora import GroupedLoraAdapter

    grouped = backend(model_dir, grouped=True, lora=_lora())
    sequential = backend(model_dir, grouped=False, lora=_lora())
    adapters = [m for m in grouped.model[0].modules() if isinstance(m, GroupedLoraAdapter)]
    assert adapters and all(adapter.lora_a.shape[1] == adapter.rank for adapter in adapters)
    per_expert = _same_adapters(grouped, sequential)
    expert_ranks = {tensor.shape[0] for name, tensor in per_expert.items() if "local_experts" in name and "in." in name}
    assert expert_ranks == {adapters[0].rank} and adapters[0].rank < RANK  # rank / top_k in both layouts

    batch = lora_batch()
    mask = batch.attention_mask_BT[:, 1:].bool()
    want = sequential.token_logprobs(batch.input_ids_BT, batch.attention_mask_BT)
    got = grouped.token_logprobs(batch.input_ids_BT, batch.attention_mask_BT)
    # torch._grouped_mm rounds its fp32 sums in another order than one matmul per expert (the loop reference
    # agrees to the bit): ~1e-7 per op, 1e-5 on log-probs after the tiny Beam's six layers.
    torch.testing.assert_close(got[mask], want[mask], rtol=0.0, atol=5e-5)
    exported = dict(sequential.export_hf_weights())
    assert_close(dict(grouped.export_hf_weights()), exported, rtol=1e-6, atol=1e-7)  # adapters folded in

    got, want = grouped.train_step(batch), sequential.train_step(batch)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6, abs=1e-7)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    # The adapters' gradients (the base is frozen). The weights after Adam's step are not compared: Adam divides
    # each element by its own size, so gradients that agree to 1e-7 near zero still step by different amounts.
    assert_close(gradients(grouped), gradients(sequential), rtol=1e-5, atol=1e-7)


def test_normalize_moe_lora_gives_routed_experts_rank_over_top_k_in_the_torch_backend(model_dir):
    from protos.config import TrainerConfig
    from trainer_service.torch_backend import TorchBackend

    torch_backend = TorchBackend(model_dir, TrainerConfig(lr=1e-2, geo_mask=None, lora=_lora()))
    top_k = torch_backend.model.config.num_experts_per_tok
    ranks = {name: p.shape[-2] for name, p in torch_backend.model.named_parameters() if name.endswith("lora_A")}
    assert {rank for name, rank in ranks.items() if ".mlp.experts." in name} == {RANK // top_k}
    assert {rank for name, rank in ranks.items() if ".mlp.experts." not in name} == {RANK}
    with pytest.raises(ValueError, match="trainer.lora.rank"):
        TorchBackend(model_dir, TrainerConfig(lora=LoraConfig(rank=RANK + 1, normalize_moe_lora=True)))
