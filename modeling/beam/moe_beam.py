"""Beam's MLPs: the dense SwiGLU MLP, the fp32 grouped sigmoid router and the routed-expert MoE block.

Shape legend: N tokens (batch and sequence flattened), H hidden, E routed experts, G expert groups,
K experts per token.

HF weight names (per MoE layer ``model.layers.N.mlp``):
    gate.weight                      [E, H]  float32 always
    gate.e_score_correction_bias     [E]     float32 always (a buffer: updated by load balancing, not SGD)
    experts.{e}.gate_proj.weight     [moe_intermediate, H]
    experts.{e}.up_proj.weight       [moe_intermediate, H]
    experts.{e}.down_proj.weight     [H, moe_intermediate]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from modeling.beam.configuration_beam import BeamConfig


class BeamMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``; the dense MLP and each routed expert."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def keeping_fp32(fn):
    """Wrap a ``Module._apply`` function so fp32 tensors only move device, never change dtype.

    Used by every router implementation of Beam (this reference, the Megatron module) so the router
    weight and correction bias stay fp32 through ``.to(bfloat16)``, ``.half()`` and the like.
    """

    def keep_fp32(tensor: torch.Tensor) -> torch.Tensor:
        moved = fn(tensor)
        if tensor.dtype == torch.float32 and moved.dtype != torch.float32:
            return tensor.to(device=moved.device)
        return moved

    return keep_fp32


class Fp32Module(nn.Module):
    """A module whose float32 parameters and buffers stay float32 through ``.to(dtype)``/``.half()``.

    Routing decisions are discrete: a bf16 router flips experts for near-tied scores, so the router
    weight and its correction bias keep fp32 whatever the rest of the model is cast to. Device moves
    still apply. When a cast would change the dtype, the original fp32 tensor is moved instead, so no
    precision is lost on the way.
    """

    def _apply(self, fn, recurse=True):
        return super()._apply(keeping_fp32(fn), recurse)


class BeamRouter(Fp32Module):
    """Sigmoid scores, bias-corrected grouped top-k selection, normalized and scaled weights, all fp32.

    DeepSeek-V3 "noaux_tc" routing: the correction bias steers only which experts are picked; the
    weights come from the unbiased scores. A group's score is the sum of its two best biased scores.
    """

    def __init__(self, config: BeamConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        num_experts = config.n_routed_experts
        self.weight = nn.Parameter(torch.empty(num_experts, config.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, hidden_N_H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (weights [N, K] fp32, expert ids [N, K], router logits [N, E] fp32)."""
        logits_N_E = F.linear(hidden_N_H.float(), self.weight)
        scores_N_E = logits_N_E.sigmoid()
        biased_N_E = scores_N_E + self.e_score_correction_bias
        allowed_N_E = self.top_group_mask(biased_N_E)
        ids_N_K = biased_N_E.masked_fill(~allowed_N_E, float("-inf")).topk(self.top_k, dim=-1).indices
        weights_N_K = scores_N_E.gather(-1, ids_N_K)
        if self.norm_topk_prob:
            weights_N_K = weights_N_K / weights_N_K.sum(dim=-1, keepdim=True)
        return weights_N_K * self.routed_scaling_factor, ids_N_K, logits_N_E

    def top_group_mask(self, biased_N_E: torch.Tensor) -> torch.Tensor:
        """True for experts in the ``topk_group`` best groups of each token."""
        num_tokens, num_experts = biased_N_E.shape
        grouped_N_G_X = biased_N_E.view(num_tokens, self.n_group, num_experts // self.n_group)
        group_scores_N_G = grouped_N_G_X.topk(2, dim=-1).values.sum(dim=-1)
        top_groups = group_scores_N_G.topk(self.topk_group, dim=-1).indices
        group_mask_N_G = torch.zeros_like(group_scores_N_G, dtype=torch.bool).scatter_(1, top_groups, True)
        return group_mask_N_G.unsqueeze(-1).expand_as(grouped_N_G_X).reshape(num_tokens, num_experts)


class BeamMoE(nn.Module):
    """Routed experts only (no shared expert); outputs are summed in fp32, then cast back."""

    def __init__(self, config: BeamConfig):
        super().__init__()
        self.gate = BeamRouter(config)
        self.experts = nn.ModuleList(
            BeamMLP(config.hidden_size, config.moe_intermediate_size) for _ in range(config.n_routed_experts)
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        hidden_N_H = hidden_states.reshape(-1, shape[-1])
        weights_N_K, ids_N_K, _ = self.gate(hidden_N_H)
        out_N_H = torch.zeros(hidden_N_H.shape, dtype=torch.float32, device=hidden_N_H.device)
        for expert_id in ids_N_K.unique().tolist():
            token_idx, slot = torch.where(ids_N_K == expert_id)
            expert_out = self.experts[expert_id](hidden_N_H[token_idx])
            out_N_H.index_add_(0, token_idx, expert_out.float() * weights_N_K[token_idx, slot, None])
        return out_N_H.to(hidden_states.dtype).reshape(shape)
