"""The Beam pieces megatron-core's stock modules cannot express (HF reference: ``modeling/beam/``).

Everything else in a Beam layer is stock megatron-core: ``SelfAttention`` (fused QKV with the elementwise sigmoid
output gate, ``attention_output_gate``; per-head q/k norms; RoPE skipped on full layers through ``no_rope_freq``),
``MLP`` (SwiGLU), ``MoELayer`` with ``SequentialMLP`` experts, ``TopKRouter``'s grouped sigmoid top-k with expert
bias (``moe_router_score_function="sigmoid"``, ``moe_router_enable_expert_bias``, ``moe_router_num_groups``,
``moe_router_group_topk``, ``moe_router_topk_scaling_factor``).

Custom, each the smallest change on top of a stock class:
    BeamRMSNorm               the HF norm's rounding (normalise in fp32, cast, then scale); TP/SP-aware weight
    BeamCoreAttention         ``DotProductAttention`` + SSMax query scaling (full layers) + a sliding window that
                              keeps the caller's padding mask
    BeamFusedCoreAttention    the same on ``FusedCoreAttention`` (SDPA; ``trainer.megatron.fused_attention``)
    BeamTransformerLayer      ``TransformerLayer`` + sandwich post-norms + depth-scaled residual adds
    BeamRouter                ``TopKRouter`` whose weight and expert bias stay fp32 in a bf16 model
    SoftcappedOutputLayer     mixin on the output ``ColumnParallelLinear``: ``cap * tanh(logits / cap)``

Shape legend (megatron order): S sequence, B batch, N heads on this TP rank, D head_dim, K keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from modeling.beam.moe_beam import keeping_fp32
from trainer_service.megatron.fused_attention import FusedCoreAttention


class BeamRMSNorm(torch.nn.Module):
    """RMSNorm as ``modeling.beam.modeling_beam.BeamRMSNorm`` rounds it: ``weight * (x32 / rms(x32)).to(dtype)``.

    ``torch.nn.RMSNorm`` (megatron's local norm) multiplies by the weight before casting back and refuses
    sequence parallelism; this one marks its weight ``sequence_parallel`` so that megatron sums its gradient over
    the TP ranks, each of which normalised only its slice of the sequence.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **unused):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.eps = eps
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def is_flagged(pattern: list[int] | None, layer_number: int) -> bool:
    """``pattern`` is per layer (0-indexed list), ``layer_number`` megatron's global 1-indexed number."""
    return bool(pattern) and bool(pattern[layer_number - 1])


class _SSMaxQuery:
    """SSMax for the full layers (``config.ssmax_freq``): the query at position p is multiplied by
    ``s_h * log(p + 1)``, in fp32, with a learnable ``ssmax_scale`` per head (this rank's heads; sharded like them)."""

    def init_ssmax(self, config) -> None:
        self.ssmax_scale = None
        if is_flagged(config.ssmax_freq, self.layer_number):
            heads = self.num_attention_heads_per_partition
            scale_N = torch.full((heads,), float(config.ssmax_init_scale), dtype=config.params_dtype)
            self.ssmax_scale = torch.nn.Parameter(scale_N)
            set_tensor_model_parallel_attributes(self.ssmax_scale, is_parallel=True, dim=0, stride=1)

    def ssmax_query(self, query_SBND: torch.Tensor) -> torch.Tensor:
        """``q * s_h * log(n)``, n = position + 1 (keys a causal query sees), in fp32 as the reference does."""
        if self.ssmax_scale is None:
            return query_SBND
        log_n_S = torch.log(torch.arange(query_SBND.size(0), device=query_SBND.device, dtype=torch.float32) + 1.0)
        factor_S1N1 = (log_n_S[:, None, None] * self.ssmax_scale.float())[..., None]
        return (query_SBND.float() * factor_S1N1).to(query_SBND.dtype)


class BeamFusedCoreAttention(_SSMaxQuery, FusedCoreAttention):
    """``BeamCoreAttention`` on ``scaled_dot_product_attention`` (``trainer.megatron.fused_attention``): SSMax on
    the full layers, flash-style causal attention, blocked sliding windows, no [T, T] mask for right-padded rows
    (``trainer_service.megatron.fused_attention``)."""

    def __init__(self, config, layer_number: int, *args, **kwargs):
        super().__init__(config, layer_number, *args, **kwargs)
        self.init_ssmax(config)

    def forward(self, query, key, value, attention_mask, *args, **kwargs):
        if query.size(0) != key.size(0):
            raise ValueError("Beam's Megatron attention computes positions for training forwards only (no KV cache)")
        return super().forward(self.ssmax_query(query), key, value, attention_mask, *args, **kwargs)


class BeamCoreAttention(_SSMaxQuery, DotProductAttention):
    """Stock eager attention with Beam's two per-layer variants.

    Full layers: SSMax (``_SSMaxQuery``). Sliding layers (``config.window_size`` with ``window_attn_skip_freq``):
    the stock softmax, given a window, replaces the caller's mask by a causal-window mask it builds on CUDA, which
    drops key padding; here the window and causal masks are OR-ed into the caller's mask instead, so the stock
    softmax sees one complete mask.
    """

    fused_variant = BeamFusedCoreAttention

    def __init__(self, config, layer_number: int, *args, **kwargs):
        super().__init__(config, layer_number, *args, **kwargs)
        self.window_size = self.scale_mask_softmax.window_size
        self.scale_mask_softmax.window_size = None
        self.init_ssmax(config)

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if packed_seq_params is not None:
            raise ValueError("Beam's Megatron attention takes [s, b] batches; packed sequences are not supported")
        if query.size(0) != key.size(0):
            raise ValueError("Beam's Megatron attention computes positions for training forwards only (no KV cache)")
        query = self.ssmax_query(query)
        blocked_SK = self.causal_window_mask(query.size(0), key.size(0), query.device)
        attention_mask = blocked_SK if attention_mask is None else attention_mask | blocked_SK
        return super().forward(
            query,
            key,
            value,
            attention_mask,
            attn_mask_type=attn_mask_type,
            attention_bias=attention_bias,
            packed_seq_params=packed_seq_params,
        )

    def causal_window_mask(self, seq: int, keys: int, device) -> torch.Tensor:
        """Boolean [S, K], True = masked: future keys, and with a window (left, 0) keys more than left behind."""
        query_S1 = torch.arange(seq, device=device)[:, None]
        key_1K = torch.arange(keys, device=device)[None, :]
        allowed_SK = key_1K <= query_S1
        if self.window_size is not None:
            allowed_SK = allowed_SK & (key_1K >= query_S1 - self.window_size[0])
        return ~allowed_SK


@dataclass
class BeamLayerSubmodules(TransformerLayerSubmodules):
    """Stock layer submodules plus the post-norms of Beam's sandwich."""

    post_self_attn_layernorm: type = IdentityOp
    post_mlp_layernorm: type = IdentityOp


def _post_norm_scaled_add(norm, scale: float, training: bool, fused: bool):
    """Stands in for megatron's ``get_bias_dropout_add(training, fused)``: ``residual + scale * norm(output)``."""

    def add(output_with_bias, residual, dropout_prob):
        output, bias = output_with_bias
        if bias is not None:
            raise ValueError("Beam has no linear biases")
        return residual + scale * norm(output)

    return add


class BeamTransformerLayer(TransformerLayer):
    """``x = x + r * post_norm(sublayer(pre_norm(x)))`` for attention and MLP, ``r = config.residual_scale``.

    The stock layer runs ``pre_norm -> sublayer -> bias-dropout-add(residual)``; Beam's post-norm and depth scale
    are put into that last step, so the stock forward (recompute, offloading hooks) is kept unchanged.
    """

    def __init__(self, config, submodules: BeamLayerSubmodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        hidden, eps = config.hidden_size, config.layernorm_epsilon
        self.post_self_attn_layernorm = submodules.post_self_attn_layernorm(config=config, hidden_size=hidden, eps=eps)
        self.post_mlp_layernorm = submodules.post_mlp_layernorm(config=config, hidden_size=hidden, eps=eps)
        self.self_attn_bda = partial(_post_norm_scaled_add, self.post_self_attn_layernorm, config.residual_scale)
        self.mlp_bda = partial(_post_norm_scaled_add, self.post_mlp_layernorm, config.residual_scale)


class BeamRouter(TopKRouter):
    """``TopKRouter`` whose weight and ``expert_bias`` stay fp32 through ``.bfloat16()`` (``Float16Module``).

    Routing decisions are discrete, so the HF model keeps ``gate.weight`` and ``e_score_correction_bias`` fp32
    (``_keep_in_fp32_modules_strict``); the stock router casts its weight to ``params_dtype`` and lets the bf16
    wrapper round the bias (it re-widens it afterwards, too late). Device moves still apply.
    """

    def reset_parameters(self):
        if self.config.perform_initialization:
            self.config.init_method(self.weight)
        self.weight.sequence_parallel = self.config.sequence_parallel

    def _apply(self, fn, recurse=True):
        return super()._apply(keeping_fp32(fn), recurse)


class SoftcappedOutputLayer(torch.nn.Module):
    """Mixin for the output ``ColumnParallelLinear`` (applied with ``extend_instance``, as megatron-bridge's Gemma 2
    does): logits become ``cap * tanh(logits / cap)``, elementwise, so vocab-parallel shards need nothing extra."""

    def forward(self, *args, **kwargs):
        logits, bias = super().forward(*args, **kwargs)
        cap = self.config.final_logit_softcapping
        return torch.tanh(logits / cap) * cap, bias


def extend_instance(obj: torch.nn.Module, mixin: type) -> None:
    """Put ``mixin`` in front of ``obj``'s class; the class name stays, so name-based TP detection still works."""
    base = obj.__class__
    obj.__class__ = type(base.__name__, (mixin, base), {})


def default_ssmax_init_scale() -> float:
    """The HF default: SSMax equals plain softmax at 4096 keys."""
    return 1.0 / math.log(4096)
