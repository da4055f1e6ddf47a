"""The whole run: the shared keys at the top and one section per role."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from protos.config.agent import AgentConfig
from protos.config.base import Strict
from protos.config.checkpoint import resolve_max_model_len
from protos.config.coordinator import BUILT_IN_TASKS, CoordinatorConfig, SamplingConfig
from protos.config.launcher import LauncherConfig
from protos.config.logger import LoggerConfig
from protos.config.rollout import DEMO_MAX_MODEL_LEN, TINY_CONTEXT_LENGTH, RolloutConfig
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
    export_dir: str = Field(
        "",
        description="Where the run's results go: the HF export of the final policy (export_dir/hf; LoRA runs also "
        "export_dir/adapters) and the eval dumps (export_dir/eval). '~' and '{run_id}' expand; '' = "
        "<out_dir>/export. Env alias EXPORT_PATH.",
    )
    data_dir: str = Field(
        "",
        description="Directory that relative dataset paths (coordinator.task, coordinator.eval.datasets) resolve "
        "against; '~' expands; '' = the working directory. Env alias DATA_DIR.",
    )
    placement: Literal["disaggregated", "colocated"] = Field(
        "disaggregated",
        description="'disaggregated': trainer and rollout servers on GPUs of their own. 'colocated': they share "
        "the trainer's GPUs (each node runs its trainer ranks and the rollout replicas that live there; the "
        "engine takes rollout.gpu_memory_utilization of each GPU), weights handed over in memory within a node "
        "(weight_bus.transport 'ipc'). deploy/ renders it as one pod per node.",
    )
    logger: LoggerConfig = Field(
        default_factory=LoggerConfig, description="Where step and eval figures go (console or Weights & Biases)."
    )

    @field_validator("run_id")
    @classmethod
    def _run_id_is_a_key_part(cls, value: str) -> str:
        if not value or any(c in value for c in " :\n"):
            raise ValueError("run_id must be non-empty without spaces or ':' (it is part of Redis keys)")
        return value

    @model_validator(mode="after")
    def _lengths_fit(self) -> RunConfig:
        # 1) rollout.max_model_len: unset, from the checkpoint (once: the launcher writes the number for the roles)
        rollout = self.rollout
        if not self.model_path or rollout.engine == "synthetic":  # the tiny model is built later; the stand-in has none
            resolved = DEMO_MAX_MODEL_LEN if rollout.max_model_len is None else rollout.max_model_len
            context = TINY_CONTEXT_LENGTH[self.tiny_model]
            if not self.model_path and rollout.engine != "synthetic" and resolved > context:
                raise ValueError(
                    f"rollout.max_model_len={resolved} is above the context length of the demo's tiny model "
                    f"{self.tiny_model!r} ({context}): lower it, or give a model_path"
                )
        else:
            resolved = resolve_max_model_len(self.model_path, rollout.max_model_len)
        if resolved != rollout.max_model_len:
            rollout.max_model_len = resolved
        # 2) a response must fit after at least one prompt token
        max_tokens = self.coordinator.sampling.max_tokens
        if resolved is not None and max_tokens >= resolved:
            raise ValueError(
                f"coordinator.sampling.max_tokens must be below rollout.max_model_len ({max_tokens} >= {resolved})"
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

    @model_validator(mode="after")
    def _colocated_layout_fits(self) -> RunConfig:
        if self.placement != "colocated":
            return self
        trainer, rollout = self.trainer, self.rollout
        trainer_gpus = trainer.num_nodes * trainer.num_processes
        rollout_gpus = rollout.num_servers * rollout.tensor_parallel_size * rollout.pipeline_parallel_size
        if rollout_gpus != trainer_gpus:
            raise ValueError(
                f"placement='colocated' puts the rollout replicas on the trainer's GPUs: rollout.num_servers x "
                f"tensor_parallel_size x pipeline_parallel_size = {rollout_gpus} must equal trainer.num_nodes x "
                f"trainer.num_processes = {trainer_gpus}"
            )
        if self.weight_bus.transport == "nccl":
            raise ValueError(
                "placement='colocated': weight_bus.transport='nccl' broadcasts from the trainer's GPU to GPUs of "
                "their own; colocated weights go in memory within a node, set weight_bus.transport='ipc'"
            )
        if rollout.gpu_memory_utilization >= 0.9:
            raise ValueError(
                f"placement='colocated': rollout.gpu_memory_utilization={rollout.gpu_memory_utilization} leaves the "
                "trainer ranks on the same GPUs almost nothing; lower it below 0.9 (the share the engine takes)"
            )
        return self

    @model_validator(mode="after")
    def _lora_sync_fits_the_engine(self) -> RunConfig:
        lora, slot = self.trainer.lora, self.rollout.lora
        if lora.sync == "adapters" and not slot.enabled:
            raise ValueError(
                "trainer.lora.sync='adapters' sends adapters only: set rollout.lora.enabled=true so the engines "
                "serve them in LoRA slots (or trainer.lora.sync='merged')"
            )
        if slot.enabled and lora.sync != "adapters":
            raise ValueError(
                "rollout.lora.enabled serves adapters on a frozen base, which cannot load the full or merged "
                "weights this trainer publishes: set trainer.lora.sync='adapters' (LoRA runs) or "
                "rollout.lora.enabled=false"
            )
        if slot.enabled and slot.max_rank < lora.rank:
            raise ValueError(
                f"rollout.lora.max_rank ({slot.max_rank}) is below trainer.lora.rank ({lora.rank}): the slot must "
                "hold the adapter; raise rollout.lora.max_rank"
            )
        return self

    def expand_path(self, path: str) -> str:
        """A path setting with '{run_id}' and a leading '~' expanded ('' stays '')."""
        return os.path.expanduser(path.replace("{run_id}", self.run_id)) if path else ""

    def run_dir(self) -> Path:
        """The run directory: out_dir, or runs/<run_id> under the working directory."""
        return Path(self.out_dir or Path("runs") / self.run_id)

    def export_path(self) -> Path:
        """Where the final policy's HF export and the eval dumps go (``export_dir``, default <run dir>/export)."""
        return Path(self.expand_path(self.export_dir)) if self.export_dir else self.run_dir() / "export"

    def log_path(self) -> Path:
        """Where the role logs and Weights & Biases run files go (``logger.log_path``, default <run dir>/logs)."""
        return Path(self.expand_path(self.logger.log_path)) if self.logger.log_path else self.run_dir() / "logs"

    def dataset_path(self, path: str) -> str:
        """A dataset path as the coordinator opens it: relative ones under ``data_dir`` when set."""
        if not self.data_dir or os.path.isabs(path):
            return path
        return os.path.join(self.expand_path(self.data_dir), path)

    def with_dataset_paths(self) -> RunConfig:
        """A copy whose dataset paths (task, eval datasets and the keys of eval labels) are as the coordinator opens
        them, joined to ``data_dir``, which the copy no longer sets."""
        if not self.data_dir:
            return self
        coordinator = self.coordinator
        evals = coordinator.eval
        task = coordinator.task if coordinator.task in BUILT_IN_TASKS else self.dataset_path(coordinator.task)
        resolved_eval = evals.model_copy(
            update={
                "datasets": [self.dataset_path(path) for path in evals.datasets],
                "labels": {self.dataset_path(path): label for path, label in evals.labels.items()},
            }
        )
        resolved = coordinator.model_copy(update={"task": task, "eval": resolved_eval})
        return self.model_copy(update={"coordinator": resolved, "data_dir": ""})

    def training_sampling(self) -> SamplingConfig:
        """The sampling of one training request: ``coordinator.sampling`` at the run's ``temperature`` (a fresh
        object: a live change applies to later requests)."""
        return SamplingConfig(temperature=self.temperature, **self.coordinator.sampling.model_dump())

    def eval_sampling(self) -> SamplingConfig:
        """The sampling of one eval request: ``coordinator.eval.sampling``, else the training sampling."""
        return self.coordinator.eval.sampling or self.training_sampling()
