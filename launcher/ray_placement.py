"""What ``fleetrl up`` asks Ray for: the bundles of each role, the layouts it refuses, and the trainer's gang.

A rollout replica's bundle holds its whole engine (TP x PP GPUs with ``launcher.ray.use_gpus``, CPUs only otherwise,
as in the tiny recipes). The trainer's ranks are one gang: one placement group with a bundle per trainer node, each
rank a ``RoleActor`` given torchrun's environment (``roles.rank_environments``); when one rank fails the driver stops
them all and starts them again together, as torchrun does, counting one restart of the trainer against
``launcher.restart``.
"""

from __future__ import annotations

import time
from pathlib import Path

import ray
from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from launcher import roles
from launcher.ray_actors import RoleActor
from launcher.supervision import RestartBackoff, RoleFailed, log_tail
from protos.config import RunConfig

RANK_STOP_GRACE_S = 10.0


# The custom resources the KubeRay rendering (deploy/kuberay.py) gives the rollout and trainer worker groups (one per
# GPU) and the head (1): asking for them puts each role on its own group.
ROLE_RESOURCES = {
    roles.ROLLOUT: "fleetrl_rollout",
    roles.TRAINER: "fleetrl_trainer",
    roles.COORDINATOR: "fleetrl_coordinator",
}


def resolve_cluster_choices(config: RunConfig, cluster: dict[str, float]) -> None:
    """Settle ``launcher.ray.use_gpus`` and ``role_resources`` left at None by what ``cluster`` (Ray's
    cluster_resources) has; the run's config.json records the choice."""
    ray_config = config.launcher.ray
    if ray_config.use_gpus is None:
        ray_config.use_gpus = cluster.get("GPU", 0) > 0
    if ray_config.role_resources is None:
        ray_config.role_resources = all(name in cluster for name in ROLE_RESOURCES.values())


def _with_role_resource(config: RunConfig, role: str, bundle: dict[str, float], count: float) -> dict[str, float]:
    return {**bundle, ROLE_RESOURCES[role]: count} if config.launcher.ray.role_resources else bundle


def rollout_bundle(config: RunConfig) -> dict[str, float]:
    """One rollout replica: its CPUs and, on GPUs, TP x PP of them (one node: a bundle never spans nodes)."""
    ray_config, rollout = config.launcher.ray, config.rollout
    gpus = rollout.tensor_parallel_size * rollout.pipeline_parallel_size
    bundle = {"CPU": ray_config.rollout_cpus, **({"GPU": gpus} if ray_config.use_gpus else {})}
    return _with_role_resource(config, roles.ROLLOUT, bundle, gpus)


def trainer_bundles(config: RunConfig) -> tuple[list[dict[str, float]], str]:
    """(a bundle per trainer node holding its ``trainer.num_processes`` ranks, the placement strategy)."""
    ray_config, trainer = config.launcher.ray, config.trainer
    bundle = {"CPU": ray_config.trainer_cpus_per_rank * trainer.num_processes}
    if ray_config.use_gpus:
        bundle["GPU"] = trainer.num_processes
    bundle = _with_role_resource(config, roles.TRAINER, bundle, trainer.num_processes)
    return [bundle] * trainer.num_nodes, "STRICT_PACK" if trainer.num_nodes == 1 else "STRICT_SPREAD"


def trainer_rank_resources(config: RunConfig) -> dict[str, float]:
    """What one rank's actor takes of its node's bundle."""
    ray_config = config.launcher.ray
    rank = {"CPU": ray_config.trainer_cpus_per_rank, **({"GPU": 1} if ray_config.use_gpus else {})}
    return _with_role_resource(config, roles.TRAINER, rank, 1)


def coordinator_resources(config: RunConfig) -> dict[str, float]:
    return _with_role_resource(config, roles.COORDINATOR, {"CPU": config.launcher.ray.coordinator_cpus}, 1)


def actor_options(resources: dict[str, float]) -> dict:
    """Ray actor options asking for ``resources`` (CPU, GPU and custom ones)."""
    custom = {name: amount for name, amount in resources.items() if name not in ("CPU", "GPU")}
    return {"num_cpus": resources.get("CPU", 0), "num_gpus": resources.get("GPU", 0), "resources": custom}


def check_placeable(config: RunConfig, local: bool) -> None:
    """Refuse, before anything starts, a run this launcher cannot place; the message names the field and the fix."""
    if config.weight_bus.transport == "ipc" and config.launcher.ray.use_gpus:
        raise RoleFailed(
            "weight_bus.transport='ipc' shares one GPU between the trainer and the engine, which fleetrl up does not "
            "place (each role gets GPUs of its own); use weight_bus.transport='nccl' or 'tcp', or fleetrl demo"
        )
    if config.weight_bus.transport == "nccl" and not config.launcher.ray.use_gpus:
        raise RoleFailed("weight_bus.transport='nccl' needs GPUs: set launcher.ray.use_gpus=true, or use 'tcp'")
    if local and config.trainer.num_nodes > 1:
        raise RoleFailed(
            f"trainer.num_nodes={config.trainer.num_nodes} on a local Ray cluster (one node): join a cluster with "
            "--ray auto|ADDRESS, or set trainer.num_nodes=1"
        )
    if config.agent.demo_agents:
        raise RoleFailed(
            "agent.demo_agents: fleetrl up starts no example agents; run them against the agent API yourself, "
            "or use fleetrl demo"
        )


def wait_placed(group: PlacementGroup, what: str, timeout_s: float) -> None:
    """Until Ray reserved ``group``'s bundles; RoleFailed naming what the cluster lacks after ``timeout_s``."""
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RoleFailed(
            f"placement group of {what} ({group.bundle_specs}) not placed within {timeout_s:.0f}s; the cluster has "
            f"{ray.available_resources()} free (launcher.ray.placement_timeout_s, launcher.ray.*_cpus, use_gpus)"
        ) from None


class TrainerGang(RestartBackoff):
    """The trainer's ranks, one ``RoleActor`` each in one placement group; restarted together when one fails."""

    def __init__(self, config: RunConfig, config_path: Path, role_actor_args: dict, local: bool):
        self.config = config
        self.config_path = config_path
        self.local = local
        super().__init__(config.launcher.restart)
        trainer = config.trainer
        self.world_size = trainer.num_nodes * trainer.num_processes
        bundles, strategy = trainer_bundles(config)
        self.group = placement_group(bundles, strategy=strategy, name=f"fleetrl-{config.run_id}-trainer")
        wait_placed(self.group, "the trainer's ranks", config.launcher.ray.placement_timeout_s)
        resources = actor_options(trainer_rank_resources(config))
        self.actors = [
            ray.remote(RoleActor)
            .options(
                **resources,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, rank // trainer.num_processes),
            )
            .remote(policy=self.policy.model_dump(), restart=False, **role_actor_args)
            for rank in range(self.world_size)
        ]
        self.names = [roles.TRAINER] if self.world_size == 1 else [f"trainer-rank-{r}" for r in range(self.world_size)]
        self.log_dir = Path(role_actor_args["log_dir"])

    def start(self) -> None:
        """Every rank with torchrun's environment; a fresh MASTER_PORT on rank 0's node at every (re)start."""
        places = ray.get([actor.placement.remote() for actor in self.actors], timeout=60)
        master_port = ray.get(self.actors[0].free_port.remote(), timeout=60)
        envs = roles.rank_environments(
            [p["node_id"] for p in places], [p["gpus"] for p in places], places[0]["ip"], master_port
        )
        # Rank 0 publishes the weights: it advertises its node's address unless the cluster is this machine.
        extra = () if self.local else (f"weight_bus.host={places[0]['ip']}",)
        specs = [roles.trainer_rank_spec(self.config_path, env, extra) for env in envs]
        ray.get([actor.start.remote(spec) for actor, spec in zip(self.actors, specs, strict=True)], timeout=60)

    def report_refs(self) -> list:
        return [actor.report.remote() for actor in self.actors]

    def supervise(self, reports: list[dict], now_s: float | None = None) -> str:
        """Restart the gang when due; stop it and schedule the restart when a rank failed; end the run (RoleFailed) when
        a rank refused to start (a restart would fail the same way). Returns what happened."""
        now_s = time.monotonic() if now_s is None else now_s
        restarting = self.restart_when_due(now_s, "trainer")
        if restarting is not None:
            return restarting
        failed = next((r for r in reports if r["state"] == "failed"), None)
        if failed is None:
            return ""
        if failed.get("refused"):  # EXIT_CANNOT_RESTART or never ready: every restart would fail the same way
            raise RoleFailed(
                f"{failed['name']} {failed['refused']}; the trainer is not restarted (it would fail the same way); "
                f"last log lines:\n{log_tail(self.log_dir / (failed['name'] + '.log'))}"
            )
        ray.get([actor.stop.remote(RANK_STOP_GRACE_S) for actor in self.actors], timeout=RANK_STOP_GRACE_S + 60)
        what = f"{failed['name']} (pid {failed['pid']}) exited"
        if self.restarts_exhausted():
            raise RoleFailed(
                f"{what}; gave up after {self.restarts} restarts of the trainer (launcher.restart.max_restarts="
                f"{self.policy.max_restarts}); last log lines:\n{log_tail(self.log_dir / (failed['name'] + '.log'))}"
            )
        delay_s = self.schedule_restart(now_s)
        return f"{what}; restart {self.restarts + 1} of the trainer's {self.world_size} ranks in {delay_s:.1f}s"
