"""The layout of a run on Kubernetes: pods and GPUs per role, and the config settings pods need.

Pure functions over ``RunConfig``. They refuse layouts one node cannot hold (naming the config field and the fix)
and turn a laptop config (loopback interfaces, port 0 = pick a free one, embedded Redis, runs/ under the working
directory) into one whose addresses and paths work between pods.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

from protos.config import RunConfig
from protos.config.coordinator import BUILT_IN_TASKS

RUN_VOLUME_PATH = "/fleetrl-run"  # the shared ReadWriteMany volume: out_dir, checkpoints, weight snapshots
CONFIG_DIR = "/etc/fleetrl"  # where the ConfigMap is mounted; every role reads CONFIG_DIR/config.json
REDIS_SERVICE_URL = "redis://redis:6379/0"  # the Redis StatefulSet's Service (rendered unless redis_url is set)
ROLLOUT_SERVICE = "rollout"  # headless Service: pods are rollout-<i>.rollout
TRAINER_SERVICE = "trainer"  # headless Service: pods are trainer-<i>.trainer
RDZV_PORT = 29400  # torchrun's c10d rendezvous on trainer-0
# Ports used where the config leaves them at 0 (a free port, unknown to a Service). The metrics ports follow
# deploy/prometheus/prometheus.yml so the same Grafana dashboard works.
DEFAULT_ROLLOUT_PORT = 50051
DEFAULT_ADMIN_PORT = 50050
DEFAULT_DASHBOARD_PORT = 8080
DEFAULT_COORDINATOR_METRICS_PORT = 9100
ROLLOUT_METRICS_PORT = 9101  # a command-line flag of rollout_service, not a config field
DEFAULT_TRAINER_METRICS_PORT = 9200


class LayoutError(ValueError):
    """A config this renderer cannot turn into pods; the message names the config field and the fix."""


@dataclass(frozen=True)
class RolePods:
    """How many pods one role gets and how many GPUs each pod asks for."""

    role: str
    num_pods: int
    gpus_per_pod: int

    @property
    def total_gpus(self) -> int:
        return self.num_pods * self.gpus_per_pod


def trainer_pods(config: RunConfig, gpus_per_node: int) -> RolePods:
    """One pod per trainer node, each with one GPU per rank (torchrun --nproc-per-node)."""
    tcfg = config.trainer
    if tcfg.num_processes > gpus_per_node:
        raise LayoutError(
            f"trainer.num_processes={tcfg.num_processes} ranks per node exceeds the {gpus_per_node} GPUs of one node "
            f"(--gpus-per-node); spread the ranks over nodes, e.g. trainer.num_nodes="
            f"{tcfg.num_nodes * -(-tcfg.num_processes // gpus_per_node)} trainer.num_processes={gpus_per_node}"
        )
    return RolePods("trainer", tcfg.num_nodes, tcfg.num_processes)


def rollout_gpus_per_replica(config: RunConfig) -> int:
    """TP x PP. Expert parallelism adds no GPUs: vLLM's EP size is TP x DP and every replica here has DP 1."""
    return config.rollout.tensor_parallel_size * config.rollout.pipeline_parallel_size


def rollout_spans_nodes(config: RunConfig, gpus_per_node: int) -> bool:
    return rollout_gpus_per_replica(config) > gpus_per_node


def rollout_pods(config: RunConfig, gpus_per_node: int, allow_multi_node: bool) -> RolePods:
    """One pod per rollout server; a replica larger than a node is refused unless explicitly allowed."""
    gpus = rollout_gpus_per_replica(config)
    if gpus > gpus_per_node and not allow_multi_node:
        raise LayoutError(
            f"rollout.tensor_parallel_size x rollout.pipeline_parallel_size = {config.rollout.tensor_parallel_size} x "
            f"{config.rollout.pipeline_parallel_size} = {gpus} GPUs per replica exceeds one node's {gpus_per_node} "
            "GPUs (--gpus-per-node). A replica across nodes needs vLLM on a Ray cluster, which rollout_service does "
            "not start and this renderer does not render. Lower rollout.pipeline_parallel_size or "
            "rollout.tensor_parallel_size, or pass --allow-multi-node-rollout to render one pod per replica asking "
            f"for {gpus} GPUs (it stays Pending on {gpus_per_node}-GPU nodes until multi-node vLLM is built)"
        )
    return RolePods("rollout", config.rollout.num_servers, gpus)


def summary(pods: list[RolePods], cpu_roles: list[str]) -> str:
    """E.g. 'trainer 4 pods x 8 GPUs = 32; rollout 4 pods x 16 GPUs = 64; total 96 GPUs (...)'."""
    parts = [f"{p.role} {p.num_pods} pods x {p.gpus_per_pod} GPUs = {p.total_gpus}" for p in pods]
    total = sum(p.total_gpus for p in pods)
    return "; ".join(parts) + f"; total {total} GPUs (no GPU: {', '.join(cpu_roles)})"


def _under_run_volume(path: str) -> bool:
    normal = posixpath.normpath(path)
    return normal == RUN_VOLUME_PATH or normal.startswith(RUN_VOLUME_PATH + "/")


def check_paths(config: RunConfig) -> None:
    """The model must be a directory on the model volume; what the run writes must be on the shared volume."""
    if not config.model_path:
        raise LayoutError(
            "model_path is '' (the demo's tiny model, built on the fly): on a cluster every pod reads the model from "
            "the --model-pvc volume; set model_path=/models/<checkpoint dir> (where that volume is mounted)"
        )
    if not posixpath.isabs(config.model_path):
        raise LayoutError(f"model_path={config.model_path!r} must be an absolute path (the volume's mount point)")
    shared = {
        "out_dir": config.out_dir,
        "trainer.ckpt_dir": config.trainer.ckpt_dir,
        "weight_bus.snapshot_dir": config.weight_bus.snapshot_dir,
        "export_dir": config.export_dir,
        "logger.log_path": config.logger.log_path,
    }
    for field, path in shared.items():
        if path and not _under_run_volume(path):
            raise LayoutError(
                f"{field}={path!r} is not on the shared run volume: every trainer rank of every node writes there "
                f"(and rollout servers read snapshots); set it under {RUN_VOLUME_PATH}/ or leave it ''"
            )


def cluster_overrides(config: RunConfig) -> list[str]:
    """Dotted overrides for what a cluster needs and the config leaves at its laptop defaults.

    Services need fixed ports (0 picks a free one), pods must bind every interface to be reachable, and the run
    directory must be on the shared volume. Values the config sets explicitly are kept.
    """
    coordinator = config.coordinator
    overrides = ["coordinator.admin_host=0.0.0.0", "coordinator.dashboard_host=0.0.0.0"]
    if not config.redis_url:
        overrides.append(f"redis_url={REDIS_SERVICE_URL}")
    if not config.out_dir:
        overrides.append(f"out_dir={RUN_VOLUME_PATH}/{config.run_id}")
    defaults = {
        "rollout.base_port": (config.rollout.base_port, DEFAULT_ROLLOUT_PORT),
        "coordinator.admin_port": (coordinator.admin_port, DEFAULT_ADMIN_PORT),
        "coordinator.dashboard_port": (coordinator.dashboard_port, DEFAULT_DASHBOARD_PORT),
        "coordinator.metrics_port": (coordinator.metrics_port, DEFAULT_COORDINATOR_METRICS_PORT),
        "trainer.metrics_port": (config.trainer.metrics_port, DEFAULT_TRAINER_METRICS_PORT),
    }
    overrides += [f"{field}={default}" for field, (value, default) in defaults.items() if value == 0]
    # A recipe's home-relative paths (the guide's ~/ckpts/<run>, ~/exports/<run>) go to the same place on the run
    # volume: every pod must see what the trainer and the coordinator write there.
    home_relative = {
        "trainer.ckpt_dir": config.trainer.ckpt_dir,
        "export_dir": config.export_dir,
        "logger.log_path": config.logger.log_path,
    }
    overrides += [
        f"{field}={RUN_VOLUME_PATH}/{path[2:]}" for field, path in home_relative.items() if path.startswith("~/")
    ]
    return overrides


def dataset_paths(config: RunConfig, workdir: str) -> list[str]:
    """The files the coordinator reads (task and eval sets, under ``data_dir``), resolved against the image's working
    directory."""
    config = config.with_dataset_paths()
    paths = [] if config.coordinator.task in BUILT_IN_TASKS else [config.coordinator.task]
    paths += config.coordinator.eval.datasets
    return [posixpath.normpath(posixpath.join(workdir, path)) for path in paths]
