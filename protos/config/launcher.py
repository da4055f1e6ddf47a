"""The launchers' section: how role processes are restarted, and how ``fleetrl up`` places them on Ray.

Both launchers read it: ``fleetrl demo`` (processes on this machine) and ``fleetrl up`` (each role process owned by
a Ray actor). See docs/deploy.md (Ray launcher).
"""

from __future__ import annotations

from pydantic import Field, model_validator

from protos.config.base import Strict


class RestartPolicy(Strict):
    """Bounded restarts with exponential backoff, per role instance (one rollout server, the trainer, ...)."""

    max_restarts: int = Field(
        3, ge=0, description="Restarts of one role instance; one more failure stops the run and names it. 0 = none."
    )
    backoff_s: float = Field(1.0, gt=0, description="Delay before the first restart of an instance.")
    max_backoff_s: float = Field(30.0, gt=0, description="Longest delay: each further restart doubles it up to this.")

    @model_validator(mode="after")
    def _backoff_bounds(self) -> RestartPolicy:
        if self.max_backoff_s < self.backoff_s:
            raise ValueError(
                f"launcher.restart.max_backoff_s ({self.max_backoff_s}) must not be below launcher.restart.backoff_s "
                f"({self.backoff_s}); raise it or lower backoff_s"
            )
        return self

    def delay_s(self, restart: int) -> float:
        """Seconds to wait before restart number ``restart`` (1 = the first)."""
        return min(self.backoff_s * 2 ** max(0, restart - 1), self.max_backoff_s)


class RayConfig(Strict):
    """``fleetrl up``: the Ray cluster and what each role asks it for (placement groups: docs/deploy.md, Ray launcher)."""

    address: str = Field(
        "local",
        description="'local' starts a Ray cluster on this machine; 'auto' or HOST:PORT (or ray://...) joins one. "
        "`fleetrl up --ray` sets it.",
    )
    num_cpus: int | None = Field(
        None, gt=0, description="Logical CPUs of a 'local' cluster; None = this machine's count."
    )
    namespace: str = Field("fleetrl", description="Ray namespace of the run's named actors.")
    use_gpus: bool | None = Field(
        None,
        description="Ask for GPUs: TP x PP per rollout replica's bundle, one per trainer rank; False: CPUs only; "
        "None: whether the cluster has GPUs (a CPU machine runs the tiny recipes on CPUs).",
    )
    role_resources: bool | None = Field(
        None,
        description="Also ask for the custom resources fleetrl_rollout / fleetrl_trainer (one per GPU, or per "
        "replica and rank without GPUs) and fleetrl_coordinator (1) that the KubeRay rendering (python -m "
        "deploy.render --kuberay) gives its worker groups and head, so each role lands on its own group; None: "
        "whether the cluster declares them.",
    )
    rollout_cpus: float = Field(1.0, ge=0, description="CPUs in each rollout replica's bundle.")
    trainer_cpus_per_rank: float = Field(1.0, ge=0, description="CPUs in each trainer rank's bundle.")
    coordinator_cpus: float = Field(1.0, ge=0, description="CPUs of the coordinator's actor.")
    redis_cpus: float = Field(0.5, ge=0, description="CPUs of the embedded valkey's actor (when redis_url is '').")
    placement_timeout_s: float = Field(
        600.0, gt=0, description="Longest wait for a placement group's resources (the cluster may be scaling up)."
    )


class LauncherConfig(Strict):
    """What starts and supervises the role processes."""

    restart: RestartPolicy = Field(default_factory=RestartPolicy, description="Restart policy of every role.")
    ray: RayConfig = Field(default_factory=RayConfig, description="`fleetrl up` on Ray.")
