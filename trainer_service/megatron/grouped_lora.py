"""LoRA on grouped experts: one batched adapter per expert projection, applied with grouped matmuls.

Every targeted projection of a ``GroupedExperts`` (``linear_fc1`` in ``trainer.lora.target_modules`` -> ``fc1``,
``linear_fc2`` -> ``fc2``) gets ``adapter``: A ``lora_a`` and B ``lora_b``, run next to the
base grouped matmul as two more, ``out += (dropout(x) @ A[e]^T) @ B[e]^T * alpha / R`` for each row of expert e.
It is megatron-bridge's per-expert ``ParallelLinearAdapter`` on a ``SequentialMLP`` expert, batched: A [E, R, K]
stacks that adapter's ``linear_in.weight`` [R, K] and B [E, N, R] its ``linear_out.weight`` [N, R] (the layout of
a megatron linear's weight, as the base [E, N, K]: the matmuls read memory as the per-expert ones do, so fp32
results agree to the last bit); A Kaiming-uniform, B zero (step 0 is the base model), dropout on the input.

R is ``trainer.lora.rank``, or ``rank / top_k`` with ``trainer.lora.normalize_moe_lora`` (megatron-bridge's
``normalize_moe_lora``: a token's top_k experts together hold about one dense adapter's capacity).

Export folds the adapters into the base weights (``merged_expert_weight``: megatron-bridge's merge arithmetic, fp32
``W + alpha / R * B^T A^T`` cast back); checkpoints keep ``lora_a`` / ``lora_b``, whose names hold ``.adapter.``,
which is what an adapter-only checkpoint keeps. Expert tensor parallelism > 1 is refused (each rank would hold a
slice of N or K and the replicated factor's gradient would need a reduction over the expert-TP group).

Shape legend: as ``grouped_experts``; R the expert adapter rank.
"""

from __future__ import annotations

import math

import torch

from protos.config import LoraConfig
from trainer_service.megatron.grouped_experts import ExpertRows, GroupedExpertLinear, GroupedExperts, grouped_mm

# trainer.lora.target_modules name -> GroupedExperts attribute.
EXPERT_TARGETS = {"linear_fc1": "fc1", "linear_fc2": "fc2"}


def expert_rank(config: LoraConfig, top_k: int) -> int:
    """The experts' adapter rank: ``trainer.lora.rank``, or ``rank / top_k`` with ``normalize_moe_lora``."""
    if not config.normalize_moe_lora:
        return config.rank
    if config.rank % top_k:
        raise ValueError(
            f"trainer.lora.rank {config.rank} must be divisible by the router's top_k {top_k} with "
            "trainer.lora.normalize_moe_lora (expert rank = rank / top_k)"
        )
    return config.rank // top_k


class GroupedLoraAdapter(torch.nn.Module):
    """The low-rank term of one grouped projection: ``(x @ A[e]^T) @ B[e]^T * alpha / R`` per row of expert e."""

    def __init__(self, base: GroupedExpertLinear, rank: int, alpha: float, dropout: float):
        super().__init__()
        num_experts, out_features, in_features = base.weight.shape
        factory = {"dtype": base.weight.dtype, "device": base.weight.device}
        a_ERK = torch.empty(num_experts, rank, in_features, **factory)
        for matrix in a_ERK:  # each expert as a Linear(in, R) weight, like the per-expert adapter's linear_in
            torch.nn.init.kaiming_uniform_(matrix, a=math.sqrt(5))
        self.lora_a = torch.nn.Parameter(a_ERK)
        self.lora_b = torch.nn.Parameter(torch.zeros(num_experts, out_features, rank, **factory))
        for factor in (self.lora_a, self.lora_b):  # reduced over the same data-parallel group as the base
            factor.allreduce = base.weight.allreduce
        self.alpha = alpha
        self.rank = rank
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def forward(self, x_TK: torch.Tensor, rows: ExpertRows) -> torch.Tensor:
        low_TR = grouped_mm(self.dropout(x_TK), self.lora_a.transpose(1, 2), rows)
        return grouped_mm(low_TR, self.lora_b.transpose(1, 2), rows) * self.scale


def merged_expert_weight(linear: GroupedExpertLinear, expert: int) -> torch.Tensor:
    """Expert ``expert``'s weight [N, K] of ``linear`` with its adapter folded in (the weight itself without one)."""
    weight_NK = linear.weight.detach()[expert]
    adapter = linear.adapter
    if adapter is None:
        return weight_NK
    with torch.no_grad():
        # megatron-bridge's LoRAMerge on fp32 copies: base + scale * (linear_out @ linear_in), cast back.
        linear_out_NR = adapter.lora_b[expert].float()
        linear_in_RK = adapter.lora_a[expert].float()
        return (weight_NK.float() + adapter.scale * (linear_out_NR @ linear_in_RK)).to(weight_NK.dtype)


def add_grouped_adapters(model_chunks: list, config: LoraConfig) -> int:
    """Give every targeted projection of every ``GroupedExperts`` its adapter; returns how many were added.

    Runs after the base is frozen: the adapters are the only new trainable tensors.
    """
    projections = [EXPERT_TARGETS[target] for target in config.target_modules if target in EXPERT_TARGETS]
    added = 0
    for chunk in model_chunks:
        for experts in (module for module in chunk.modules() if isinstance(module, GroupedExperts)):
            if projections and experts.tp_group.size() > 1:
                raise ValueError(
                    "trainer.megatron.expert_tensor_parallel_size: LoRA on grouped experts needs 1 "
                    "(or trainer.megatron.moe_grouped_lora=false for per-expert adapters)"
                )
            rank = expert_rank(config, experts.config.moe_router_topk)
            for name in projections:
                linear = getattr(experts, name)
                linear.adapter = GroupedLoraAdapter(linear, rank, config.alpha, config.dropout)
                added += 1
    return added
