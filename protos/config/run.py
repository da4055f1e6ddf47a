"""The whole run: the shared keys at the top and one section per role."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from protos.config.agent import AgentConfig
from protos.config.base import Strict
from protos.config.coordinator import CoordinatorConfig
from protos.config.rollout import RolloutConfig
from protos.config.trainer import TrainerConfig
from protos.config.weight_bus import WeightBusConfig


class RunConfig(Strict):
    """The whole run. Shared keys live here and are read by every role."""

    run_id: str = Field("demo", description="Namespace of the run's Redis keys.")
    model_path: str = Field("", description="HF checkpoint directory; '' = build (and cache) the demo's tiny model.")
    tiny_model: Literal["qwen3-moe", "beam", "qwen3-moe-1b"] = Field(
        "qwen3-moe",
        description="Which model the demo builds when model_path is '': the tiny Qwen3-MoE, the tiny "
        "Beam, or the GPU demo's 0.94 B Qwen3-MoE (bf16; warmed up on the GPU). All have the echo vocabulary.",
    )
    redis_url: str = Field("", description="Redis URL; '' = start an embedded valkey server.")
    out_dir: str = Field("", description="Run directory (logs, summary.json, checkpoints).")
    coordinator: CoordinatorConfig = Field(default_factory=CoordinatorConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    weight_bus: WeightBusConfig = Field(default_factory=WeightBusConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)

    @field_validator("run_id")
    @classmethod
    def _run_id_is_a_key_part(cls, value: str) -> str:
        if not value or any(c in value for c in " :\n"):
            raise ValueError("run_id must be non-empty without spaces or ':' (it is part of Redis keys)")
        return value

    @model_validator(mode="after")
    def _lengths_fit(self) -> RunConfig:
        if self.coordinator.sampling.max_tokens >= self.rollout.max_model_len:
            raise ValueError(
                "coordinator.sampling.max_tokens must be below rollout.max_model_len "
                f"({self.coordinator.sampling.max_tokens} >= {self.rollout.max_model_len})"
            )
        return self
