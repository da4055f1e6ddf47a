"""Fused core attention for the Megatron backend: ``scaled_dot_product_attention`` instead of megatron-core's
eager ``DotProductAttention`` (``trainer.megatron.fused_attention``).

The stock local-spec attention multiplies out the [B, N, T, T] scores, fills a materialised [B, 1, T, T] mask and
runs a softmax over it. Here:

- causal layers: one ``scaled_dot_product_attention(is_causal=True)`` call (FlashAttention on a GPU), no mask;
- sliding-window layers (attend to the last ``window + 1`` keys): the sequence is cut into blocks of
  ``window + 1`` queries; block ``i`` attends to blocks ``i - 1`` and ``i`` through one constant
  [window + 1, 2 (window + 1)] band mask, block 0 causally to itself. Exact, O(T x window) memory and work; the
  query heads of one key head are stacked along the query axis, so keys and values are never repeated per head;
- an explicit mask (a batch whose padding is not on the right, or a caller's own [B, 1, T, T] mask): SDPA with
  that mask, ORed with the causal (and window) mask; each query may always see itself, so no row is empty.

Padding: ``forward.stage_output`` passes no mask when every row is right-padded, which is how fleetrl builds its
batches. A real token then only sees keys before it, all real, so its output equals the padded-mask path's; the
padded positions after the last real token see each other and differ, but they feed no loss and no log-prob.

``with_fused_core_attention`` turns a provider's layer spec into one with the fused modules; megatron-core's
``DotProductAttention`` becomes ``FusedCoreAttention`` and a custom core attention names its fused form in a
``fused_variant`` attribute (Beam's ``BeamCoreAttention``).

Shape legend: S/T sequence, B batch, N query heads, G key/value heads (this TP rank's), D head_dim, W block,
X batch x blocks, Q the query heads of one key head x W.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec


def causal_attention(q_BNTD, k_BGTD, v_BGTD, scale: float, window: int | None = None, dropout_p: float = 0.0):
    """Causal attention, with a window when ``window`` (keys at most ``window`` positions behind) is given."""
    seq = q_BNTD.shape[2]
    if window is None or window + 1 >= seq:
        return _sdpa(q_BNTD, k_BGTD, v_BGTD, scale, dropout_p, is_causal=True)
    return _sliding_window_attention(q_BNTD, k_BGTD, v_BGTD, scale, window, dropout_p)


def masked_attention(q_BNTD, k_BGTD, v_BGTD, masked_B1TT, scale: float, window: int | None = None, dropout_p=0.0):
    """Attention under the caller's boolean mask (True = masked), plus causality and the window."""
    seq, device = q_BNTD.shape[2], q_BNTD.device
    query_T1 = torch.arange(seq, device=device)[:, None]
    key_1T = torch.arange(seq, device=device)[None, :]
    allowed_TT = key_1T <= query_T1
    if window is not None:
        allowed_TT &= key_1T >= query_T1 - window
    allowed_B1TT = (~masked_B1TT & allowed_TT) | (key_1T == query_T1)
    return _sdpa(q_BNTD, k_BGTD, v_BGTD, scale, dropout_p, mask=allowed_B1TT)


def _sdpa(q_BNTD, k_BGTD, v_BGTD, scale, dropout_p, is_causal=False, mask=None):
    groups = q_BNTD.shape[1] // k_BGTD.shape[1]
    if mask is None:  # the flash kernel takes grouped keys as they are
        return F.scaled_dot_product_attention(
            q_BNTD, k_BGTD, v_BGTD, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=groups > 1
        )
    # Kernels that take a mask do not all take grouped keys: repeat them (what the stock attention does).
    k_BNTD, v_BNTD = (t.repeat_interleave(groups, dim=1) if groups > 1 else t for t in (k_BGTD, v_BGTD))
    return F.scaled_dot_product_attention(q_BNTD, k_BNTD, v_BNTD, attn_mask=mask, dropout_p=dropout_p, scale=scale)


def _sliding_window_attention(q_BNTD, k_BGTD, v_BGTD, scale: float, window: int, dropout_p: float):
    """Blocks of W = window + 1 queries; block i > 0 attends to blocks i - 1 and i through one band mask."""
    batch, heads, seq, _ = q_BNTD.shape
    groups = heads // k_BGTD.shape[1]
    block = window + 1
    padded = -seq % block  # zero rows after the end: later than every real query, so causally invisible
    q_BNTD, k_BGTD, v_BGTD = (F.pad(t, (0, 0, 0, padded)) for t in (q_BNTD, k_BGTD, v_BGTD))
    num_blocks = (seq + padded) // block
    first_BNWD = _sdpa(*(t[:, :, :block] for t in (q_BNTD, k_BGTD, v_BGTD)), scale, dropout_p, is_causal=True)
    if num_blocks == 1:
        return first_BNWD[:, :, :seq]
    # Query q of a block sits at key column q + W of [previous block, own block]; it sees columns q + 1 .. q + W.
    query_W1 = torch.arange(block, device=q_BNTD.device)[:, None]
    key_12W = torch.arange(2 * block, device=q_BNTD.device)[None, :]
    band_W2W = (key_12W > query_W1) & (key_12W <= query_W1 + block)

    def blocks(tensor_BHTD, start: int, width: int):
        """[B * (num_blocks - 1), H, width * W, D]: from block ``start`` on, ``width`` consecutive blocks each."""
        per_block = tensor_BHTD.unflatten(2, (num_blocks, block))
        spans = [per_block[:, :, start + offset : start + offset + num_blocks - 1] for offset in range(width)]
        span = torch.cat(spans, dim=3) if width > 1 else spans[0]  # [B, H, num_blocks - 1, width * W, D]
        return span.transpose(1, 2).flatten(0, 1)

    # Grouped-query heads sharing a key head are stacked along the query axis (the mask repeated to match), so the
    # keys are not repeated per query head: [., G, groups * W, D] against [., G, 2W, D].
    q_XGQD = blocks(q_BNTD, 1, 1).unflatten(1, (-1, groups)).flatten(2, 3)
    band_Q2W = band_W2W.repeat(groups, 1)
    out_XGQD = F.scaled_dot_product_attention(
        q_XGQD, blocks(k_BGTD, 0, 2), blocks(v_BGTD, 0, 2), attn_mask=band_Q2W, dropout_p=dropout_p, scale=scale
    )
    rest_XNWD = out_XGQD.unflatten(2, (groups, block)).flatten(1, 2)
    rest_BNTD = rest_XNWD.unflatten(0, (batch, num_blocks - 1)).transpose(1, 2).flatten(2, 3)
    return torch.cat([first_BNWD, rest_BNTD], dim=2)[:, :, :seq]


class FusedCoreAttention(DotProductAttention):
    """megatron-core's ``DotProductAttention`` computed by ``scaled_dot_product_attention`` (module docstring).

    Same constructor, parameters and [S, B, N, D] -> [S, B, N * D] interface; the window comes from the same
    config (``window_size`` on the layers ``window_attn_skip_freq`` marks).
    """

    def __init__(self, config, layer_number: int, attn_mask_type, *args, k_channels=None, v_channels=None, **kwargs):
        # Multi-latent attention (DeepSeek-V3) passes its query/key and value head sizes, which the stock local
        # attention does not take; SDPA reads both off the tensors, and MLA passes its own softmax scale.
        del k_channels, v_channels
        super().__init__(config, layer_number, attn_mask_type, *args, **kwargs)
        if self.attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"megatron.fused_attention: only causal layers, this one is {self.attn_mask_type}")
        if self.softmax_offset is not None:
            raise ValueError(f"megatron.fused_attention: softmax_type {config.softmax_type!r} is not supported")
        window = self.scale_mask_softmax.window_size
        self.window = None if window is None else int(window[0])
        if window is not None and window[1] != 0:
            raise ValueError(f"megatron.fused_attention: only left windows (n, 0), got window_size {window}")
        # Query-key layer scaling divides the scores by the layer number and the softmax multiplies it back.
        self.scale = self.softmax_scale * (self.scale_mask_softmax.scale or 1.0)

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("megatron.fused_attention takes [s, b] batches without packing or attention bias")
        if query.size(0) != key.size(0):
            raise ValueError("megatron.fused_attention computes training forwards only (no KV cache)")
        q_BNTD, k_BGTD, v_BGTD = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout_p = self.attention_dropout.p if self.training else 0.0
        # Dropout draws from the model-parallel RNG as the stock attention does (with dropout 0 it draws nothing).
        forked = dropout_p and not self.config.sequence_parallel
        with tensor_parallel.get_cuda_rng_tracker().fork() if forked else contextlib.nullcontext():
            if attention_mask is None:
                out_BNTD = causal_attention(q_BNTD, k_BGTD, v_BGTD, self.scale, self.window, dropout_p)
            else:
                out_BNTD = masked_attention(q_BNTD, k_BGTD, v_BGTD, attention_mask, self.scale, self.window, dropout_p)
        return out_BNTD.permute(2, 0, 1, 3).flatten(2)


def fused_form(core_attention: type) -> type:
    """The fused class standing in for ``core_attention`` (itself when it is fused already)."""
    if issubclass(core_attention, FusedCoreAttention):
        return core_attention
    if core_attention is DotProductAttention:
        return FusedCoreAttention
    fused = getattr(core_attention, "fused_variant", None)
    if fused is None:
        raise ValueError(f"megatron.fused_attention: no fused form of {core_attention.__name__}; set it to false")
    return fused


def _fused_layer(layer_spec: ModuleSpec, config) -> ModuleSpec:
    if getattr(config, "softmax_type", "vanilla") != "vanilla":
        # Attention sinks (gpt-oss's learnable softmax offset) have no SDPA form: megatron-core's own attention,
        # which implements them, stays in these layers.
        return layer_spec
    attention = layer_spec.submodules.self_attention
    slots = attention.submodules
    slots = dataclasses.replace(slots, core_attention=fused_form(slots.core_attention))
    attention = dataclasses.replace(attention, submodules=slots)
    return dataclasses.replace(
        layer_spec, submodules=dataclasses.replace(layer_spec.submodules, self_attention=attention)
    )


def with_fused_core_attention(layer_spec):
    """A provider's ``transformer_layer_spec`` (a layer ``ModuleSpec``, or a function of the provider giving one or
    a block's ``TransformerBlockSubmodules``) with every core attention in its fused form."""

    def fused_spec(config, vp_stage=None):
        spec = layer_spec
        if not isinstance(spec, ModuleSpec):
            takes_stage = "vp_stage" in inspect.signature(layer_spec).parameters
            spec = layer_spec(config, vp_stage=vp_stage) if takes_stage else layer_spec(config)
        if isinstance(spec, ModuleSpec):
            return _fused_layer(spec, config)
        return dataclasses.replace(spec, layer_specs=[_fused_layer(layer, config) for layer in spec.layer_specs])

    return fused_spec
