"""A tiny random Beam checkpoint with the full model's structure, plus the tiny char tokenizer.

Same structure as Beam at toy size: dense layers then MoE layers, sliding (RoPE) layers closed by full
(NoPE + SSMax) layers, grouped sigmoid routing with a correction bias, gated attention, sandwich
norms, soft-capped logits. head_dim is 32 because vLLM's CPU attention rejects 16. The tokenizer
files are the ones ``modeling.tiny_model`` writes (vocabulary 64).
"""

from __future__ import annotations

from pathlib import Path

from modeling.beam.configuration_beam import BeamConfig
from modeling.tiny_model import BOS_ID, EOS_ID, PAD_ID, save_tiny_checkpoint, warmup_echo


def tiny_beam_config(**overrides) -> BeamConfig:
    """6 layers (1 dense, 5 MoE; sliding, sliding, full, sliding, sliding, full), window 16,
    16 experts top-4 in 4 groups (top 2 groups), 4 query / 2 KV heads of 32, hidden 64."""
    fields = dict(
        vocab_size=64,
        hidden_size=64,
        num_hidden_layers=6,
        first_k_dense_replace=1,
        intermediate_size=4 * 64,  # num_experts_per_tok * moe_intermediate_size, as in the full model
        moe_intermediate_size=64,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=16,
        full_attention_interval=3,
        max_position_embeddings=1024,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        dtype="float32",
    )
    fields.update(overrides)
    return BeamConfig(**fields)


def spread_random_weights(model, seed: int) -> None:
    """Make a fresh random model informative for parity tests.

    At init the logits are nearly uniform, norms are all ones, correction biases zero and every SSMax
    scale equal: a wrong implementation could still match. Here: LM head std 0.5 (peaked
    distributions, soft-cap active), router std 0.1, correction biases N(0, 0.05), norm weights
    U(0.5, 1.5), SSMax scales U(0.2, 1.0) per head.
    """
    import torch

    generator = torch.Generator().manual_seed(seed + 1)

    def fill(tensor, values):
        tensor.data.copy_(values.to(tensor.dtype))

    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            shape = tensor.shape
            if name == "lm_head.weight":
                fill(tensor, torch.randn(shape, generator=generator) * 0.5)
            elif name.endswith("mlp.gate.weight"):
                fill(tensor, torch.randn(shape, generator=generator) * 0.1)
            elif name.endswith("e_score_correction_bias"):
                fill(tensor, torch.randn(shape, generator=generator) * 0.05)
            elif name.endswith("norm.weight"):
                fill(tensor, 0.5 + torch.rand(shape, generator=generator))
            elif name.endswith("ssmax_scale"):
                fill(tensor, 0.2 + 0.8 * torch.rand(shape, generator=generator))


def init_tiny_beam(path: str | Path, seed: int = 0, warmup_steps: int = 0, **config_overrides) -> Path:
    """Write a tiny random Beam checkpoint (safetensors, fp32) and the char tokenizer into ``path``.

    ``warmup_steps > 0`` then fits it briefly to the noisy echo corpus (``modeling.tiny_model``), as
    ``init_tiny`` does, so an RL demo starts from partial skill.
    """
    import torch

    from modeling.beam.modeling_beam import BeamForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = BeamForCausalLM(tiny_beam_config(**config_overrides)).to(torch.float32)
    spread_random_weights(model, seed)
    if warmup_steps:
        warmup_echo(model, warmup_steps, seed=seed)
    return save_tiny_checkpoint(model, path)
