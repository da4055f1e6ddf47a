"""Kubernetes building blocks shared by every role's manifest: options, labels, volumes, containers, Services.

Plain dicts, as ``deploy.manifests`` assembles them into each role's objects.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from deploy import layout
from protos.config import RunConfig

CONFIG_MAP_NAME = "fleetrl-config"
CONFIG_PATH = f"{layout.CONFIG_DIR}/config.json"
GPU_RESOURCE = "nvidia.com/gpu"  # the NVIDIA device plugin's resource name


@dataclass(frozen=True)
class RenderOptions:
    """What the cluster provides; the run config says everything else."""

    image: str
    model_pvc: str
    run_pvc: str
    model_subpath: str = ""
    data_pvc: str = ""
    redis_image: str = "valkey/valkey:8"
    redis_storage: str = "20Gi"
    gpus_per_node: int = 8
    allow_multi_node_rollout: bool = False
    workdir: str = "/opt/fleetrl"
    backoff_limit: int = 3
    rollout_ready_timeout_s: int = 7200
    kuberay: bool = False  # a RayCluster + RayJob (fleetrl up) instead of the plain rollout/trainer/coordinator
    ray_version: str = "2.60.0"  # the Ray in the image (the RayCluster's rayVersion)


@dataclass
class Manifest:
    """One output file: a comment header (why things are as they are) and its objects."""

    filename: str
    comment: list[str]
    objects: list[dict] = field(default_factory=list)


def label_value(text: str) -> str:
    """Kubernetes label values allow [A-Za-z0-9_.-], at most 63 characters, alphanumeric at both ends."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", text)[:63].strip("-_.") or "run"


def labels(config: RunConfig, role: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "fleetrl",
        "app.kubernetes.io/component": role,
        "app.kubernetes.io/instance": label_value(config.run_id),
    }


def metadata(config: RunConfig, name: str, role: str, annotations: dict[str, str] | None = None) -> dict:
    meta = {"name": name, "labels": labels(config, role)}
    if annotations:
        meta["annotations"] = annotations
    return meta


def scrape_annotations(port: int) -> dict[str, str]:
    """Read by deploy/prometheus/prometheus-kubernetes.yml (and most Prometheus charts' pod scrape jobs)."""
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}


def field_env(name: str, field_path: str) -> dict:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field_path}}}


# Volumes --------------------------------------------------------------------------------------------------------
def config_volume() -> tuple[dict, dict]:
    return (
        {"name": "config", "configMap": {"name": CONFIG_MAP_NAME}},
        {"name": "config", "mountPath": layout.CONFIG_DIR, "readOnly": True},
    )


def model_volume(config: RunConfig, options: RenderOptions) -> tuple[dict, dict]:
    mount = {"name": "model", "mountPath": config.model_path, "readOnly": True}
    if options.model_subpath:
        mount["subPath"] = options.model_subpath
    return {"name": "model", "persistentVolumeClaim": {"claimName": options.model_pvc, "readOnly": True}}, mount


def run_volume(options: RenderOptions, read_only: bool = False) -> tuple[dict, dict]:
    return (
        {"name": "run", "persistentVolumeClaim": {"claimName": options.run_pvc}},
        {"name": "run", "mountPath": layout.RUN_VOLUME_PATH, "readOnly": read_only},
    )


def shm_volume() -> tuple[dict, dict]:
    # Docker's default /dev/shm is 64 MiB; NCCL and vLLM's tensor-parallel workers exchange buffers through it.
    return ({"name": "dshm", "emptyDir": {"medium": "Memory"}}, {"name": "dshm", "mountPath": "/dev/shm"})


def data_volumes(config: RunConfig, options: RenderOptions) -> tuple[list[dict], list[dict]]:
    """The data PVC, mounted read-only at each directory the coordinator reads datasets from."""
    directories = sorted({path.rsplit("/", 1)[0] for path in layout.dataset_paths(config, options.workdir)})
    if not options.data_pvc or not directories:
        return [], []
    volume = {"name": "data", "persistentVolumeClaim": {"claimName": options.data_pvc, "readOnly": True}}
    return [volume], [{"name": "data", "mountPath": directory, "readOnly": True} for directory in directories]


def container(options: RenderOptions, name: str, args: list[str], mounts: list[dict], **extra) -> dict:
    return {
        "name": name,
        "image": options.image,
        "imagePullPolicy": "IfNotPresent",
        "workingDir": options.workdir,
        "command": args[:1],
        "args": args[1:],
        "volumeMounts": mounts,
        **extra,
    }


def gpu_limits(num_gpus: int) -> dict:
    return {"limits": {GPU_RESOURCE: num_gpus}}


def headless_service(config: RunConfig, name: str, role: str, port: int) -> dict:
    # publishNotReadyAddresses: pods resolve by name before they are ready (a server binds its own name at start,
    # torchrun's rendezvous runs before any readiness).
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(config, name, role),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": labels(config, role),
            "ports": [{"name": "main", "port": port}],
        },
    }
