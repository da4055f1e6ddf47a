"""BeamForCausalLM: a readable, fp32-exact transformers reference of Beam (see docs/models/beam.md).

Per decoder layer (``x`` the residual stream, ``r = scale_depth / sqrt(num_hidden_layers)``):

    x = x + r * post_attention_layernorm(attn(input_layernorm(x)))
    x = x + r * post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))

Attention: GQA with per-head RMSNorm on q and k. Sliding layers apply RoPE and see the last
``sliding_window`` keys; full layers use no position encoding (NoPE) and SSMax, i.e. the query of
position p is multiplied by ``s_h * log(p + 1)`` with a learnable ``s_h`` per head. The output of every
head is multiplied by ``sigmoid(gate)`` before ``o_proj``; the gate logits come from ``q_proj``.

Shape legend: B batch, T new tokens, S keys (cache included), H hidden, D head_dim, h heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from modeling.beam.configuration_beam import FULL, BeamConfig
from modeling.beam.moe_beam import BeamMLP, BeamMoE, BeamRouter


class BeamRMSNorm(nn.Module):
    """RMSNorm computed in fp32, cast back, then scaled by ``weight`` (Llama/Qwen form, weight init 1)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def apply_rope(x_BThD: torch.Tensor, positions_BT: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX-style rotary embedding (rotate halves), angles computed in fp32."""
    dim = x_BThD.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=x_BThD.device) / dim))
    angles = positions_BT.float()[..., None] * inv_freq  # [B, T, D/2]
    cos = torch.cat([angles, angles], dim=-1).cos()[:, :, None, :].to(x_BThD.dtype)
    sin = torch.cat([angles, angles], dim=-1).sin()[:, :, None, :].to(x_BThD.dtype)
    first, second = x_BThD.chunk(2, dim=-1)
    return x_BThD * cos + torch.cat([-second, first], dim=-1) * sin


def ssmax_query_scale(scale_h: torch.Tensor, positions_BT: torch.Tensor) -> torch.Tensor:
    """SSMax factor ``s_h * log(n)`` with n = position + 1 keys visible to a causal query: [B, T, h, 1]."""
    log_n = torch.log(positions_BT.float() + 1.0)
    return (log_n[..., None] * scale_h.float())[..., None]


def attention_mask(q_len: int, kv_len: int, past_len: int, window: int | None, padding_BS, device) -> torch.Tensor:
    """Boolean [B or 1, 1, T, S], True where a query may attend.

    Queries sit at cache slots ``past_len + t``; the returned keys are the newest ``kv_len`` slots (a
    sliding cache hands back only the recent ones). A key is visible if it is not in the future and,
    with a window, fewer than ``window`` slots behind. ``padding_BS`` is the usual 2-D padding mask
    over all ``past_len + q_len`` slots (1 = real token) or None.
    """
    total = past_len + q_len
    q_slot = torch.arange(past_len, total, device=device)[:, None]
    k_slot = torch.arange(total - kv_len, total, device=device)[None, :]
    allowed = k_slot <= q_slot
    if window is not None:
        allowed = allowed & (k_slot > q_slot - window)
    allowed = allowed[None, None]
    if padding_BS is not None:
        allowed = allowed & padding_BS[:, None, None, -kv_len:].bool()
    return allowed


class BeamAttention(nn.Module):
    """GQA with q/k RMSNorm, RoPE + window (sliding) or NoPE + SSMax (full), and a sigmoid output gate."""

    def __init__(self, config: BeamConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.gate_dim = config.head_dim, config.gate_dim
        self.is_full = config.layer_types[layer_idx] == FULL
        self.window = None if self.is_full else config.sliding_window
        self.rope_theta = config.rope_parameters["rope_theta"]
        self.scaling = self.head_dim**-0.5
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * (self.head_dim + self.gate_dim), bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = BeamRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = BeamRMSNorm(self.head_dim, config.rms_norm_eps)
        if self.is_full:
            self.ssmax_scale = nn.Parameter(torch.full((self.num_heads,), float(config.ssmax_init_scale)))

    def forward(self, x_BTH, positions_BT, padding_BS=None, cache: Cache | None = None) -> torch.Tensor:
        batch, q_len, _ = x_BTH.shape
        q_gate = self.q_proj(x_BTH).view(batch, q_len, self.num_heads, self.head_dim + self.gate_dim)
        q_BThD, gate_BThG = q_gate.split([self.head_dim, self.gate_dim], dim=-1)
        q_BThD = self.q_norm(q_BThD)
        k_BThD = self.k_norm(self.k_proj(x_BTH).view(batch, q_len, self.num_kv_heads, self.head_dim))
        v_BThD = self.v_proj(x_BTH).view(batch, q_len, self.num_kv_heads, self.head_dim)
        if self.is_full:
            q_BThD = (q_BThD.float() * ssmax_query_scale(self.ssmax_scale, positions_BT)).to(q_BThD.dtype)
        else:
            q_BThD = apply_rope(q_BThD, positions_BT, self.rope_theta)
            k_BThD = apply_rope(k_BThD, positions_BT, self.rope_theta)
        q, k, v = (t.transpose(1, 2) for t in (q_BThD, k_BThD, v_BThD))  # [B, h, T, D]
        past_len = cache.get_seq_length(self.layer_idx) if cache is not None else 0
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        mask = attention_mask(q_len, k.shape[2], past_len, self.window, padding_BS, x_BTH.device)
        out_BhTD = self.eager_attention(q, k, v, mask)
        out_BThD = out_BhTD.transpose(1, 2) * torch.sigmoid(gate_BThG)
        return self.o_proj(out_BThD.reshape(batch, q_len, self.num_heads * self.head_dim))

    def eager_attention(self, q, k, v, mask) -> torch.Tensor:
        """Softmax attention in fp32 (masked logits get the dtype's minimum, never NaN)."""
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        logits = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        logits = logits.masked_fill(~mask, torch.finfo(logits.dtype).min)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(v.dtype)
        return torch.matmul(probs, v)


class BeamDecoderLayer(nn.Module):
    """Sandwich norms around attention and MLP, depth-scaled residual adds."""

    def __init__(self, config: BeamConfig, layer_idx: int):
        super().__init__()
        self.residual_scale = config.residual_scale
        self.self_attn = BeamAttention(config, layer_idx)
        is_moe = config.is_moe_layer(layer_idx)
        self.mlp = BeamMoE(config) if is_moe else BeamMLP(config.hidden_size, config.intermediate_size)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = BeamRMSNorm(hidden, eps)
        self.post_attention_layernorm = BeamRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = BeamRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = BeamRMSNorm(hidden, eps)

    def forward(self, x_BTH, positions_BT, padding_BS=None, cache: Cache | None = None) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x_BTH), positions_BT, padding_BS, cache)
        x_BTH = x_BTH + self.residual_scale * self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(x_BTH))
        return x_BTH + self.residual_scale * self.post_feedforward_layernorm(mlp)


class BeamPreTrainedModel(PreTrainedModel):
    config_class = BeamConfig
    config: BeamConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["BeamDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    # Router weight and correction bias load as fp32 even when the model loads in bf16/fp16.
    _keep_in_fp32_modules_strict = ["mlp.gate.weight", "mlp.gate.e_score_correction_bias"]

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, BeamRouter):
            module.weight.normal_(mean=0.0, std=self.config.initializer_range)
            module.e_score_correction_bias.zero_()
        elif isinstance(module, BeamAttention) and module.is_full:
            module.ssmax_scale.fill_(self.config.ssmax_init_scale)


class BeamModel(BeamPreTrainedModel):
    def __init__(self, config: BeamConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(BeamDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = BeamRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """``attention_mask`` is a 2-D padding mask [B, past + T] (causal and window masks are built
        per layer); ``position_ids`` drive RoPE and SSMax's key count ``n = position + 1``."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("BeamModel.forward: pass exactly one of input_ids and inputs_embeds")
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if position_ids is None:
            past = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = torch.arange(past, past + hidden.shape[1], device=hidden.device)[None]
        position_ids = position_ids.expand(hidden.shape[0], -1)
        cache = past_key_values if use_cache else None
        for layer in self.layers:
            hidden = layer(hidden, position_ids, attention_mask, cache)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden), past_key_values=cache)


class BeamForCausalLM(BeamPreTrainedModel, GenerationMixin):
    """Beam with its untied LM head and final logit soft-capping."""

    def __init__(self, config: BeamConfig):
        super().__init__(config)
        self.model = BeamModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        outputs = self.model(input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, use_cache)
        hidden = outputs.last_hidden_state[:, -logits_to_keep:, :] if logits_to_keep else outputs.last_hidden_state
        logits = softcap(self.lm_head(hidden), self.config.final_logit_softcapping)
        loss = None
        if labels is not None:
            shifted = logits[:, :-1].float().reshape(-1, logits.shape[-1])
            loss = F.cross_entropy(shifted, labels[:, 1:].reshape(-1), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values)


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(logits / cap)`` (Gemma 2's final logit soft-capping); identity when cap is None."""
    return logits if not cap else torch.tanh(logits / cap) * cap


__all__ = ["BeamForCausalLM", "BeamModel", "BeamPreTrainedModel"]
