"""The whole run: the shared keys at the top and one section per role."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from protos.config.agent import AgentConfig
from protos.config.base import Strict
from protos.config.coordinator import CoordinatorConfig, SamplingConfig
from protos.config.launcher import LauncherConfig
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
    num_steps: int = Field(
        40,
        gt=0,
        description="Training steps of the run: the trainer stops after them, the coordinator produces "
        "num_steps x groups_per_step groups.",
    )
    groups_per_step: int = Field(
        8,
        gt=0,
        description="Groups per training step (B): the trainer takes B from the queue per step, the "
        "coordinator's slot arithmetic (slot i trains at version start + i // B) counts in them.",
    )
    max_staleness: int = Field(
        1,
        ge=0,
        description="Bound k on v_trainer - min token version; 0 = on-policy. The coordinator admits "
        "within it, the trainer drops groups beyond it. Settable at run time (fleetrl set max_staleness=...).",
    )
    temperature: float = Field(
        1.0,
        ge=0.0,
        description="Sampling temperature of training rollouts; 1.0 keeps logprobs exact. The trainer "
        "scores at the temperature each group records, this one where none is. Settable at run time.",
    )
    coordinator: CoordinatorConfig = Field(default_factory=CoordinatorConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    weight_bus: WeightBusConfig = Field(default_factory=WeightBusConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    launcher: LauncherConfig = Field(default_factory=LauncherConfig)

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

    @model_validator(mode="after")
    def _heartbeats_outlive_their_timeout(self) -> RunConfig:
        interval_s, timeout_s = self.rollout.heartbeat_interval_s, self.coordinator.server_timeout_s
        if timeout_s < 2 * interval_s:
            raise ValueError(
                f"coordinator.server_timeout_s ({timeout_s}) must be at least twice rollout.heartbeat_interval_s "
                f"({interval_s}): one late beat would drop a live server; raise the timeout or beat more often"
            )
        return self

    @model_validator(mode="after")
    def _eval_samples_can_differ(self) -> RunConfig:
        evals = self.coordinator.eval
        if evals.datasets and evals.samples_per_problem > 1 and self.eval_sampling().temperature == 0:
            raise ValueError(
                "coordinator.eval.samples_per_problem > 1 needs a sampling temperature > 0 (greedy samples would be "
                "identical); set coordinator.eval.sampling.temperature (or the run's temperature)"
            )
        return self

    def training_sampling(self) -> SamplingConfig:
        """The sampling of one training request: ``coordinator.sampling`` at the run's ``temperature`` (a fresh
        object: a live change applies to later requests)."""
        return SamplingConfig(temperature=self.temperature, **self.coordinator.sampling.model_dump())

    def eval_sampling(self) -> SamplingConfig:
        """The sampling of one eval request: ``coordinator.eval.sampling``, else the training sampling."""
        return self.coordinator.eval.sampling or self.training_sampling()
