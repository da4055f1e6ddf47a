"""Tiny random checkpoints of every model family of the supported-models table, built locally (no downloads).

Each family's config comes from its own Hugging Face config class with the family's real architecture at toy size
(attention kind, MoE layout, shared experts, router, dense first layers, biases, sliding windows, sinks, linear
attention / Mamba layers): 2 or 3 layers, hidden 64, head_dim 32 (vLLM's CPU attention rejects 16), vocabulary 64
so the character tokenizer of ``modeling.tiny_model`` fits. ``scripts/model_matrix.py`` runs fleetrl's path on them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from modeling.tiny_model import BOS_ID, EOS_ID, PAD_ID, save_tiny_checkpoint

# Keys every family shares: the char tokenizer's vocabulary and specials, fp32, an untied head.
COMMON = dict(
    vocab_size=64,
    hidden_size=64,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
    dtype="float32",
)
ATTENTION = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32)


def qwen3():
    from transformers import Qwen3Config

    return Qwen3Config(**COMMON, **ATTENTION, intermediate_size=128, num_hidden_layers=2)


def qwen3_moe():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **COMMON,
        **ATTENTION,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    )


def qwen2_5():
    """Qwen2.5: Qwen2 with QKV biases (head_dim = hidden / heads)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        **COMMON, num_attention_heads=2, num_key_value_heads=1, intermediate_size=128, num_hidden_layers=2
    )


def llama3():
    """Llama 3: GQA and the llama3 RoPE frequency scaling, with Llama 3.1's own values (megatron-bridge's Llama
    bridge carries only ``factor`` over and fixes the other three at these values)."""
    from transformers import LlamaConfig

    rope = dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    return LlamaConfig(**COMMON, **ATTENTION, intermediate_size=128, num_hidden_layers=2, rope_parameters=rope)


def deepseek_v3():
    """DeepSeek-V3 (Kimi K2, Moonlight): MLA, one dense first layer, shared expert, grouped sigmoid routing.

    ``topk_method`` and ``scoring_func`` are no fields of transformers' config class (its model always routes by
    sigmoid scores plus ``e_score_correction_bias``), but DeepSeek-V3's own config.json carries them and vLLM reads
    them: without ``noaux_tc`` its model has no ``e_score_correction_bias`` (the checkpoint's key is then a KeyError
    in the loader), without ``sigmoid`` it would score the experts by softmax.

    The MLA latent keeps DeepSeek-V3's real size, ``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64: vLLM's CPU MLA
    backend (its decode kernel) runs only that cache width, 576 ("Head dimension 64 is not supported by MLA").

    RoPE is DeepSeek-V3's own YaRN (its config.json's values). With plain RoPE vLLM rotates MLA's per-head q and
    shared k through its CPU ``rotary_embedding`` kernel, which misreads those 3-D ``[tokens, heads, 64]`` views (for
    more than one head q comes out rotated wrong; a strided k is left unrotated): every position but the first then
    attends differently from transformers. vLLM's DeepSeek YaRN rotation runs in PyTorch on CPU and agrees.
    """
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        **COMMON,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        num_hidden_layers=2,
        first_k_dense_replace=1,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=32,
        kv_lora_rank=512,
        qk_nope_head_dim=32,
        qk_rope_head_dim=64,
        v_head_dim=32,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=40.0,
            original_max_position_embeddings=4096,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    )


def glm4_5():
    """GLM-4.5 MoE: partial RoPE, QKV biases, QK norm, one dense first layer, shared expert, sigmoid routing."""
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(
        **COMMON,
        **ATTENTION,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        intermediate_size=128,
        moe_intermediate_size=32,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        use_qk_norm=True,
        attention_bias=True,
    )


def gpt_oss():
    """gpt-oss: attention sinks, alternating sliding / full layers, biased experts with the clamped SwiGLU, and
    gpt-oss's own YaRN values (megatron-bridge's gpt-oss bridge fixes them rather than reading the config)."""
    from transformers import GptOssConfig

    return GptOssConfig(
        **COMMON,
        **ATTENTION,
        num_hidden_layers=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=64,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=150000.0,
            factor=32.0,
            original_max_position_embeddings=4096,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
        ),
    )


def qwen3_next():
    """Qwen3-Next: a gated-DeltaNet (linear attention) layer then a gated full-attention layer, MoE with a shared
    expert."""
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        **COMMON,
        **ATTENTION,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        intermediate_size=128,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=128,  # Qwen3-Next's own width, the one vLLM's CPU gated-DeltaNet kernel runs
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
    )


def nemotron_h():
    """Nemotron-H: hybrid Mamba-2 / attention / MLP layers."""
    from transformers import NemotronHConfig

    return NemotronHConfig(
        **COMMON,
        **ATTENTION,
        layers_block_type=["mamba", "attention", "mlp"],
        intermediate_size=128,
        mamba_num_heads=4,
        mamba_head_dim=16,
        ssm_state_size=16,
        n_groups=1,
        chunk_size=16,
    )


def nemotron():
    """Nemotron (dense): squared-ReLU MLP, LayerNorm1p, partial RoPE."""
    from transformers import NemotronConfig

    return NemotronConfig(**COMMON, **ATTENTION, intermediate_size=128, num_hidden_layers=2)


def mimo():
    """MiMo: a Qwen2 body served by vLLM as ``MiMoForCausalLM``; its MTP heads are dropped (as the seed does), so
    transformers builds it as Qwen2 (MiMo's own modeling code is remote code, which fleetrl never runs)."""
    config = qwen2_5()
    config.architectures = ["MiMoForCausalLM"]
    config.num_nextn_predict_layers = 0
    return config


def beam():
    from modeling.beam.tiny import tiny_beam_config

    return tiny_beam_config()


# family name -> config factory, in the order of the supported-models table
FAMILIES: dict[str, Callable] = {
    "qwen3": qwen3,
    "qwen3_moe": qwen3_moe,
    "qwen2_5": qwen2_5,
    "llama3": llama3,
    "deepseek_v3": deepseek_v3,
    "glm4_5": glm4_5,
    "gpt_oss": gpt_oss,
    "qwen3_next": qwen3_next,
    "nemotron_h": nemotron_h,
    "nemotron": nemotron,
    "mimo": mimo,
    "beam": beam,
}


def build_model(family: str, seed: int = 0):
    """A random fp32 model of ``family`` (transformers' own class for the family's config)."""
    import torch
    from transformers import AutoModelForCausalLM

    if family == "beam":
        import modeling.beam  # noqa: F401 - registers model_type "beam" with transformers' Auto classes
    torch.manual_seed(seed)
    config = FAMILIES[family]()
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def init_family(family: str, path: str | Path, seed: int = 0) -> Path:
    """Write a tiny random checkpoint of ``family`` with the char tokenizer into ``path``; returns the path."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = build_model(family, seed)
    save_tiny_checkpoint(model, path)
    architectures = getattr(FAMILIES[family](), "architectures", None)
    if architectures:  # save_pretrained writes the class it built (MiMo: Qwen2ForCausalLM): keep the family's
        config_path = path / "config.json"
        config = json.loads(config_path.read_text())
        config["architectures"] = architectures
        config_path.write_text(json.dumps(config, indent=2))
    return path
