"""The LoRA cases shared by test_lora.py (torch backend) and test_megatron_lora.py (tests/ has no packages)."""

from __future__ import annotations

from synthetic import make_group

from modeling.beam.tiny import init_tiny_beam
from modeling.tiny_model import init_tiny
from protos.config import LoraConfig, TrainerConfig
from trainer_service.batch import build_batch

ALL_TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
# The tiny Qwen3-MoE (fused expert tensors) and the tiny Beam (per-expert modules).
MODELS = ["qwen3-moe", "beam"]


def make_model_dir(model: str, tmp_path_factory) -> str:
    """A fresh tiny checkpoint of ``model`` (one of ``MODELS``), seed 0."""
    directory = tmp_path_factory.mktemp(model)
    if model == "beam":
        return str(init_tiny_beam(directory, seed=0))
    return str(init_tiny(directory, seed=0))


def lora_config(rank: int = 4, target_modules=ALL_TARGETS, **kwargs) -> TrainerConfig:
    return TrainerConfig(
        lr=1e-2, geo_mask=None, lora=LoraConfig(rank=rank, alpha=8, target_modules=target_modules), **kwargs
    )


def lora_batch(seed: int = 0):
    return build_batch([make_group(i, seed=seed) for i in range(4)])
