"""``BeamModelProvider``: megatron-core's ``GPTModel`` built from Beam's layer spec, plus the logit soft-cap.

The spec is local (non-Transformer-Engine) megatron-core modules with the custom pieces of ``modules``; it runs
on CPU and GPU. Per-layer differences are data, read by the modules from the config (one entry per layer):

    moe_layer_freq            0 dense SwiGLU MLP (the first ``first_k_dense_replace`` layers), 1 MoE
    window_attn_skip_freq     1 sliding layer: attends to ``window_size[0] + 1`` keys (own position included)
    no_rope_freq              1 full layer: no RoPE (stock megatron-core skips it)
    ssmax_freq                1 full layer: SSMax query scaling (``BeamCoreAttention``)

Parallelism goes through the stock megatron-core paths: tensor parallel (heads, gate rows, ``ssmax_scale``, MLP
and expert widths, vocabulary), sequence parallel (every norm marks its weight), expert parallel (the spec's
``SequentialMLP`` experts, which ``model.configure_provider`` swaps for ``GroupedExperts`` by default). Checked on
CPU/gloo: TP 2, EP 2, TP 2 x EP 2 with the allgather dispatcher, and PP 2 (``beam_block_spec`` builds only the
stage's layers; tests/trainer_service/test_megatron_multirank.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

from megatron.bridge.models.gpt_provider import GPTModelProvider
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from trainer_service.megatron.beam.modules import (
    BeamCoreAttention,
    BeamLayerSubmodules,
    BeamRMSNorm,
    BeamRouter,
    BeamTransformerLayer,
    SoftcappedOutputLayer,
    default_ssmax_init_scale,
    extend_instance,
)


def beam_layer_spec(moe: bool) -> ModuleSpec:
    """One Beam decoder layer: sandwich-normed gated attention, then a dense SwiGLU MLP or routed experts."""
    if moe:
        experts = LocalSpecProvider().grouped_mlp_modules(False)  # SequentialMLP of ColumnParallel/RowParallel
        mlp = partial(MoELayer, submodules=MoESubmodules(experts=experts, router=BeamRouter))
    else:
        linears = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
        mlp = partial(MLP.as_mlp_submodule, submodules=linears)
    attention = ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear,
            core_attention=BeamCoreAttention,
            linear_proj=RowParallelLinear,
            q_layernorm=BeamRMSNorm,
            k_layernorm=BeamRMSNorm,
        ),
    )
    return ModuleSpec(
        module=BeamTransformerLayer,
        submodules=BeamLayerSubmodules(
            input_layernorm=BeamRMSNorm,
            self_attention=attention,
            self_attn_bda=get_bias_dropout_add,
            post_self_attn_layernorm=BeamRMSNorm,
            pre_mlp_layernorm=BeamRMSNorm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
            post_mlp_layernorm=BeamRMSNorm,
        ),
    )


def beam_block_spec(config: BeamModelProvider, vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """The decoder layers of this pipeline stage, and the final norm."""
    if config.moe_grouped_gemm:
        # Grouped experts need Transformer Engine's grouped linear layers, which this local spec does not use.
        raise ValueError(
            "megatron.moe_grouped_gemm: the Beam spec builds per-expert (SequentialMLP) experts; use False"
        )
    layer_specs = [beam_layer_spec(moe=bool(is_moe)) for is_moe in config.moe_layer_freq]
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=layer_specs[offset : offset + count], layer_norm=BeamRMSNorm)


@dataclass
class BeamModelProvider(GPTModelProvider):
    """``GPTModelProvider`` with Beam's fields; the bridge (``BeamBridge.provider_bridge``) fills them."""

    transformer_layer_spec: object = beam_block_spec
    residual_scale: float = 1.0
    """Factor on each sublayer's post-normed output before the residual add (``BeamConfig.residual_scale``)."""
    final_logit_softcapping: float | None = None
    """Logits become ``cap * tanh(logits / cap)``; None disables."""
    ssmax_freq: list[int] = field(default_factory=list)
    """Per layer, 1 where queries get SSMax scaling (Beam: the full attention layers)."""
    ssmax_init_scale: float = field(default_factory=default_ssmax_init_scale)
    """Initial per-head SSMax scale (checkpoints carry their own)."""

    # MegatronBackend installs the stock local spec on providers unless they bring their own.
    has_local_layer_spec = True

    def provide(self, pre_process=None, post_process=None, vp_stage=None):
        model = super().provide(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
        if model.post_process and self.final_logit_softcapping:
            extend_instance(model.output_layer, SoftcappedOutputLayer)
        return model
