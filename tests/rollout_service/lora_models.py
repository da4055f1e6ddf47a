"""Dense tiny models for the LoRA slot tests: vLLM on CPU serves LoRA only without MoE layers
(rollout_service/lora_slot.py says why), so these are the tiny models with every MLP dense."""

from __future__ import annotations

from pathlib import Path

import torch

from modeling.beam.tiny import init_tiny_beam
from modeling.tiny_model import BOS_ID, EOS_ID, PAD_ID, save_tiny_checkpoint
from protos.config import LoraConfig, TrainerConfig
from trainer_service.torch_backend import TorchBackend

DENSE_MODELS = ["qwen3", "beam"]
RANK, ALPHA = 8, 16.0


def init_tiny_dense(path: Path, seed: int = 0) -> Path:
    """A tiny Qwen3 (dense, 2 layers, hidden 64, GQA 2/1 x 32, vocabulary 64, untied head) with the char tokenizer."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        torch_dtype="float32",
    )
    return save_tiny_checkpoint(AutoModelForCausalLM.from_config(config, dtype=torch.float32), Path(path))


def make_dense_model(name: str, path: Path) -> str:
    """``name`` of ``DENSE_MODELS``: the dense Qwen3, or the tiny Beam with all six layers dense."""
    if name == "beam":
        return str(init_tiny_beam(path, seed=0, first_k_dense_replace=6))
    return str(init_tiny_dense(path))


def adapter_trainer(model_dir: str) -> TorchBackend:
    """The torch backend training rank-8 adapters on every target, published as adapters."""
    config = TrainerConfig(geo_mask=None, lora=LoraConfig(rank=RANK, alpha=ALPHA, sync="adapters"))
    return TorchBackend(model_dir, config)


def set_random_adapters(backend: TorchBackend, seed: int) -> None:
    """Random A and B (as if trained far): the greedy output moves."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in backend.model.named_parameters():
            if name.endswith(("lora_A", "lora_B")):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.4)


def server_overrides() -> list[str]:
    """The rollout server's config for adapter-only sync at rank 8."""
    return [
        "rollout.lora.enabled=true",
        f"rollout.lora.max_rank={RANK}",
        f"trainer.lora.rank={RANK}",
        "trainer.lora.sync=adapters",
    ]
