"""BeamConfig: the Hugging Face config of Beam (501B-A23B MoE), with every open choice as a field.

The published card fixes most of the architecture; the fields it leaves open are marked
"(open choice)" below and argued for in docs/models/beam.md. Defaults are the full-size model;
``modeling.beam.tiny`` builds a toy config with the same structure.
"""

from __future__ import annotations

import math
from typing import Literal

from transformers import PreTrainedConfig

SLIDING, FULL = "sliding_attention", "full_attention"


def default_layer_types(num_layers: int, full_attention_interval: int) -> list[str]:
    """Runs of ``interval - 1`` sliding layers, each closed by one full layer; the last layer is full.

    For Beam (52 layers, interval 6) that gives full layers 5, 11, ..., 47 and 51: 9 full, 43 sliding,
    the card's count (the plain repeating pattern alone would give 8 full and 44 sliding).
    """
    types = [FULL if (i + 1) % full_attention_interval == 0 else SLIDING for i in range(num_layers)]
    types[-1] = FULL
    return types


class BeamConfig(PreTrainedConfig):
    """Configuration of ``BeamForCausalLM`` (``model_type: "beam"``)."""

    model_type = "beam"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 151936
    """Vocabulary size; the embedding and the (untied) LM head have this many rows."""
    hidden_size: int = 5120
    """Width of the residual stream."""
    num_hidden_layers: int = 52
    """Decoder layers: ``first_k_dense_replace`` dense-MLP layers, then MoE layers."""
    first_k_dense_replace: int = 3
    """The first this many layers use a dense SwiGLU MLP; all later layers are MoE (DeepSeek-V3 name)."""
    intermediate_size: int = 20480
    """(open choice) Dense FFN width. Default: the active expert width ``num_experts_per_tok *
    moe_intermediate_size`` (8 x 2560), as in DeepSeek-V3 and Kimi K2, so dense and MoE layers cost the
    same FLOPs per token."""
    moe_intermediate_size: int = 2560
    """SwiGLU width of one routed expert."""
    n_routed_experts: int = 256
    """Routed experts per MoE layer (no shared expert)."""
    num_experts_per_tok: int = 8
    """Experts selected per token (top-k)."""
    n_group: int = 8
    """Expert groups for grouped top-k routing; experts ``[g*E/G, (g+1)*E/G)`` form group g."""
    topk_group: int = 4
    """Groups kept per token; experts are then picked only from these groups."""
    norm_topk_prob: bool = True
    """Renormalize the selected experts' sigmoid scores to sum to 1 (before the scaling factor)."""
    routed_scaling_factor: float = 2.5
    """Multiplier on the normalized routing weights."""
    num_attention_heads: int = 48
    """Query heads."""
    num_key_value_heads: int = 8
    """Key/value heads (GQA: 6 query heads share one KV head)."""
    head_dim: int = 128
    """Per-head width of q, k and v."""
    attn_output_gate: Literal["elementwise", "headwise"] = "elementwise"
    """(open choice) Shape of the sigmoid output gate: ``elementwise`` gives each head a gate vector of
    ``head_dim`` (Qwen3-Next, "Gated Attention" G1), ``headwise`` one scalar per head. Either way the
    gate logits come from ``q_proj``, stored per head right after that head's query rows."""
    sliding_window: int = 512
    """Keys visible to a sliding layer, the query's own position included."""
    full_attention_interval: int = 6
    """Used only to derive ``layer_types`` when it is not given (see ``default_layer_types``)."""
    layer_types: list[str] | None = None
    """Per layer ``"sliding_attention"`` (RoPE, windowed) or ``"full_attention"`` (NoPE + SSMax)."""
    rope_parameters: dict | None = None
    """(open choice) RoPE of the sliding layers; default ``{"rope_type": "default", "rope_theta": 10000.0}``
    (a 512-token window needs no long-wavelength base)."""
    ssmax_init_scale: float | None = None
    """(open choice) Initial value of the learnable per-head SSMax scale ``s`` of full layers (queries
    are multiplied by ``s * log(n)``, n = keys attended). Default ``1 / log(4096)``: at 4096 keys SSMax
    starts out as plain softmax. Only initialization; trained checkpoints carry their own ``s``."""
    scale_depth: float = 1.4
    """(open choice) Depth-scaled residuals: each sublayer adds ``scale_depth / sqrt(num_hidden_layers)``
    times its (post-normed) output to the residual stream (MiniCPM's ``scale_depth``)."""
    final_logit_softcapping: float = 30.0
    """LM-head logits become ``cap * tanh(logits / cap)``."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm (sandwich norms, q/k norms, final norm)."""
    hidden_act: str = "silu"
    """Activation of the SwiGLU MLPs (only ``silu``)."""
    max_position_embeddings: int = 131072
    """(open choice) Longest sequence the config advertises; NoPE full layers impose no hard limit."""
    initializer_range: float = 0.02
    """Std of the normal init of linear and embedding weights."""
    tie_word_embeddings: bool = False
    """Beam has untied embeddings and LM head."""
    use_cache: bool = True
    """Return a KV cache from ``forward`` (generation)."""
    attention_dropout: float = 0.0
    """Kept for transformers compatibility; Beam uses none."""
    pad_token_id: int | None = None
    """Padding token id."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token id."""
    eos_token_id: int | list[int] | None = None
    """End-of-sequence token id(s)."""

    def __post_init__(self, **kwargs):
        if self.layer_types is None:
            self.layer_types = default_layer_types(self.num_hidden_layers, self.full_attention_interval)
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
        if self.ssmax_init_scale is None:
            self.ssmax_init_scale = 1.0 / math.log(4096)
        super().__post_init__(**kwargs)
        self._validate_beam()

    def _validate_beam(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - {SLIDING, FULL}:
            raise ValueError(
                f"layer_types: need {self.num_hidden_layers} entries of {SLIDING!r}/{FULL!r}, got {self.layer_types}"
            )
        if self.n_routed_experts % self.n_group or self.n_routed_experts // self.n_group < 2:
            raise ValueError("n_group: must divide n_routed_experts into groups of at least 2 experts")
        if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
            raise ValueError("topk_group: the kept groups hold fewer experts than num_experts_per_tok")
        if self.attn_output_gate not in ("elementwise", "headwise"):
            raise ValueError(f"attn_output_gate: 'elementwise' or 'headwise', got {self.attn_output_gate!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_key_value_heads: must divide num_attention_heads")

    @property
    def gate_dim(self) -> int:
        """Gate logits per head in ``q_proj``: ``head_dim`` (elementwise) or 1 (headwise)."""
        return self.head_dim if self.attn_output_gate == "elementwise" else 1

    @property
    def residual_scale(self) -> float:
        """Factor on every sublayer's output before it joins the residual stream."""
        return self.scale_depth / math.sqrt(self.num_hidden_layers)

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace


__all__ = ["BeamConfig", "default_layer_types"]
