"""Dense tiny models for the LoRA slot tests: vLLM on CPU serves LoRA only without MoE layers
(rollout_service/lora_slot.py says why), so these are the tiny models with every MLP dense."""

from __future__ import annotations

from pathlib import Path

import torch

from modeling.beam.tiny import init_tiny_beam
from modeling.tiny_model import init_tiny_dense
from protos.config import LoraConfig, TrainerConfig
from trainer_service.torch_backend import TorchBackend

DENSE_MODELS = ["qwen3", "beam"]
RANK, ALPHA = 8, 16.0


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
