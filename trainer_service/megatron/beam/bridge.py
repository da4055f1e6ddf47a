"""``BeamBridge``: megatron-bridge's HF <-> Megatron conversion for ``BeamForCausalLM`` (``model_type: "beam"``).

Registered with ``AutoBridge`` by importing this module (``trainer_service.megatron.beam.register()``), so
``AutoBridge.from_hf_pretrained(beam_checkpoint)`` builds a ``BeamModelProvider`` and loads/exports weights.

Weight layout (HF left, Megatron right; ``*`` a layer or expert index):

    q_proj (per head: head_dim query rows, then head_dim gate rows), k_proj, v_proj
                                        -> linear_qkv, per KV group [queries, gates, key, value] (stock
                                           ``QKVMapping`` with ``attention_output_gate``)
    mlp.gate.weight / e_score_correction_bias (fp32)
                                        -> mlp.router.weight / expert_bias (fp32, ``BeamRouter``)
    mlp.experts.E.{gate,up,down}_proj   -> mlp.experts.local_experts.e.linear_fc{1,2} (gate and up stacked in
                                           fc1; with expert parallelism e is the rank-local index of E)
    sandwich norms                      -> input_layernorm, post_self_attn_layernorm, pre_mlp_layernorm,
                                           post_mlp_layernorm

Only the elementwise output gate is supported: megatron-core's gate is a head_dim vector per head; a headwise
(scalar) gate could be loaded by repeating its rows, but the copies would drift apart in training and no longer
export to one row.
"""

from __future__ import annotations

from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
from megatron.bridge.models.conversion.param_mapping import (
    AutoMapping,
    ColumnParallelMapping,
    GatedMLPMapping,
    QKVMapping,
    ReplicatedMapping,
)
from megatron.core.models.gpt.gpt_model import GPTModel

from modeling.beam.configuration_beam import FULL, SLIDING, BeamConfig
from trainer_service.megatron.beam.provider import BeamModelProvider, beam_block_spec

_ONE_TO_ONE = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "output_layer.weight": "lm_head.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "decoder.layers.*.input_layernorm.weight": "model.layers.*.input_layernorm.weight",
    "decoder.layers.*.post_self_attn_layernorm.weight": "model.layers.*.post_attention_layernorm.weight",
    "decoder.layers.*.pre_mlp_layernorm.weight": "model.layers.*.pre_feedforward_layernorm.weight",
    "decoder.layers.*.post_mlp_layernorm.weight": "model.layers.*.post_feedforward_layernorm.weight",
    "decoder.layers.*.self_attention.linear_proj.weight": "model.layers.*.self_attn.o_proj.weight",
    "decoder.layers.*.self_attention.q_layernorm.weight": "model.layers.*.self_attn.q_norm.weight",
    "decoder.layers.*.self_attention.k_layernorm.weight": "model.layers.*.self_attn.k_norm.weight",
    "decoder.layers.*.mlp.linear_fc2.weight": "model.layers.*.mlp.down_proj.weight",
    "decoder.layers.*.mlp.experts.local_experts.*.linear_fc2.weight": "model.layers.*.mlp.experts.*.down_proj.weight",
}


def check_supported(config: BeamConfig) -> None:
    """Refuse the Beam config values whose arithmetic megatron-core would not reproduce."""
    if config.attn_output_gate != "elementwise":
        raise ValueError("attn_output_gate: the Megatron path supports only 'elementwise' (see the bridge docstring)")
    if config.num_experts_per_tok // config.topk_group != 2 or config.num_experts_per_tok % config.topk_group:
        # megatron-core scores a group by its top (top_k / topk_group) experts; Beam by its top 2.
        raise ValueError(
            "num_experts_per_tok / topk_group: the Megatron path needs exactly 2 (group score = top-2 sum)"
        )
    if not config.norm_topk_prob:
        raise ValueError("norm_topk_prob: megatron-core always renormalises sigmoid top-k weights; False unsupported")
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act: only 'silu' (SwiGLU) is mapped, got {config.hidden_act!r}")
    if config.tie_word_embeddings:
        raise ValueError("tie_word_embeddings: Beam's embedding and LM head are untied")


def layer_patterns(config: BeamConfig) -> dict[str, list[int]]:
    """The per-layer 0/1 lists of ``BeamModelProvider`` from ``layer_types`` and ``first_k_dense_replace``."""
    sliding = [kind == SLIDING for kind in config.layer_types]
    full = [kind == FULL for kind in config.layer_types]
    return {
        "moe_layer_freq": [int(config.is_moe_layer(i)) for i in range(config.num_hidden_layers)],
        "window_attn_skip_freq": [int(flag) for flag in sliding],
        "no_rope_freq": [int(flag) for flag in full],
        "ssmax_freq": [int(flag) for flag in full],
    }


@MegatronModelBridge.register_bridge(
    source="BeamForCausalLM", target=GPTModel, provider=BeamModelProvider, model_type="beam"
)
class BeamBridge(MegatronModelBridge):
    """HF ``BeamForCausalLM`` <-> megatron-core ``GPTModel`` with the Beam layer spec."""

    def provider_bridge(self, hf_pretrained) -> BeamModelProvider:
        config = hf_pretrained.config
        check_supported(config)
        # The stock CONFIG_MAPPING already maps sizes, heads, eps, rope theta and the DeepSeek-named MoE fields
        # (n_routed_experts, num_experts_per_tok, moe_intermediate_size, n_group, topk_group,
        # routed_scaling_factor); the rest is set here.
        provider = super().provider_bridge(hf_pretrained)
        for name, pattern in layer_patterns(config).items():
            setattr(provider, name, pattern)
        provider.transformer_layer_spec = beam_block_spec
        provider.window_size = (config.sliding_window - 1, 0)
        provider.ssmax_init_scale = config.ssmax_init_scale
        provider.residual_scale = config.residual_scale
        provider.final_logit_softcapping = config.final_logit_softcapping
        _set_attention(provider)
        _set_router(provider)
        return provider

    def mapping_registry(self) -> MegatronMappingRegistry:
        mappings = [AutoMapping(megatron_param=mc, hf_param=hf) for mc, hf in _ONE_TO_ONE.items()]
        mappings += [
            QKVMapping(
                megatron_param="decoder.layers.*.self_attention.linear_qkv.weight",
                q="model.layers.*.self_attn.q_proj.weight",
                k="model.layers.*.self_attn.k_proj.weight",
                v="model.layers.*.self_attn.v_proj.weight",
            ),
            # One scale per head: split over TP ranks with the heads.
            ColumnParallelMapping(
                "decoder.layers.*.self_attention.core_attention.ssmax_scale", "model.layers.*.self_attn.ssmax_scale"
            ),
            GatedMLPMapping(
                megatron_param="decoder.layers.*.mlp.linear_fc1.weight",
                gate="model.layers.*.mlp.gate_proj.weight",
                up="model.layers.*.mlp.up_proj.weight",
            ),
            ReplicatedMapping("decoder.layers.*.mlp.router.weight", "model.layers.*.mlp.gate.weight"),
            ReplicatedMapping(
                "decoder.layers.*.mlp.router.expert_bias", "model.layers.*.mlp.gate.e_score_correction_bias"
            ),
            GatedMLPMapping(
                megatron_param="decoder.layers.*.mlp.experts.local_experts.*.linear_fc1.weight",
                gate="model.layers.*.mlp.experts.*.gate_proj.weight",
                up="model.layers.*.mlp.experts.*.up_proj.weight",
            ),
        ]
        return MegatronMappingRegistry(*mappings)


def _set_attention(provider: BeamModelProvider) -> None:
    provider.normalization = "RMSNorm"
    provider.qk_layernorm = True
    provider.attention_output_gate = True  # elementwise sigmoid gate, rows stored in linear_qkv
    provider.attention_softmax_in_fp32 = True  # the reference's softmax is fp32 in every dtype
    provider.position_embedding_type = "rope"
    provider.rotary_interleaved = False  # rotate-half (NeoX) RoPE, as the reference
    provider.add_bias_linear = False
    provider.add_qkv_bias = False
    provider.gated_linear_unit = True
    provider.hidden_dropout = 0.0
    provider.attention_dropout = 0.0
    provider.share_embeddings_and_output_weights = False
    provider.bias_activation_fusion = False
    provider.masked_softmax_fusion = False
    provider.apply_rope_fusion = False


def _set_router(provider: BeamModelProvider) -> None:
    """DeepSeek-V3 ``noaux_tc`` routing in megatron-core's terms; group sizes and scale come from CONFIG_MAPPING."""
    provider.moe_router_score_function = "sigmoid"
    provider.moe_router_enable_expert_bias = True
    provider.moe_router_dtype = "fp32"
    provider.moe_router_pre_softmax = False
    provider.moe_router_load_balancing_type = "none"
    provider.moe_aux_loss_coeff = 0.0
    # Expert-bias balancing is opt-in (megatron.moe_router_bias_update_rate): by default the bias is the
    # checkpoint's, so the rollout engine and the trainer route alike.
    provider.moe_router_bias_update_rate = 0.0
    provider.moe_grouped_gemm = False
    provider.moe_shared_expert_intermediate_size = None
