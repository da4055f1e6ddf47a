"""KubeRay objects for one run (``python -m deploy.render ... --kuberay``): a RayCluster sized from the recipe and a
RayJob that runs ``fleetrl up /etc/fleetrl/recipe.yaml --ray auto`` on it.

The cluster: a CPU head (the coordinator's node: the Ray launcher places it there) and two GPU worker groups, one
for the rollout servers (sized from ``rollout.num_servers`` x TP x PP) and one for the trainer (``trainer.num_nodes``
pods x ``trainer.num_processes`` GPUs). Each group carries a custom Ray resource (``fleetrl_rollout``,
``fleetrl_trainer``, ``fleetrl_coordinator``) counting its GPUs (1 on the head), so the launcher can place each role
on its own nodes. Every pod mounts the run's ConfigMap at /etc/fleetrl (``recipe.yaml``: the resolved config, what
the RayJob hands to ``fleetrl up``) and the model, run and shared-memory volumes the plain manifests use.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from deploy import layout
from deploy.k8s import (
    GPU_RESOURCE,
    Manifest,
    RenderOptions,
    config_volume,
    data_volumes,
    field_env,
    labels,
    metadata,
    model_volume,
    run_volume,
    scrape_annotations,
    shm_volume,
)
from protos.config import RunConfig

RECIPE_PATH = f"{layout.CONFIG_DIR}/recipe.yaml"
RAY_DASHBOARD_PORT = 8265  # the Ray job API the RayJob submits through
RAY_GCS_PORT = 6379
RAY_CLIENT_PORT = 10001


@dataclass(frozen=True)
class RayGroup:
    """One worker group: ``replicas`` x ``num_hosts`` pods, ``gpus_per_pod`` GPUs each, for ``role``."""

    role: str
    replicas: int
    num_hosts: int
    gpus_per_pod: int

    @property
    def num_pods(self) -> int:
        return self.replicas * self.num_hosts

    @property
    def total_gpus(self) -> int:
        return self.num_pods * self.gpus_per_pod


def dns_name(text: str, max_length: int = 40) -> str:
    """A DNS-1123 label from ``text`` (KubeRay appends suffixes to the cluster's name, so it stays short)."""
    return re.sub(r"[^a-z0-9-]", "-", text.lower())[:max_length].strip("-") or "run"


def cluster_name(config: RunConfig) -> str:
    return dns_name(f"fleetrl-{config.run_id}")


def rollout_group(config: RunConfig, gpus_per_node: int) -> RayGroup:
    """Rollout servers packed onto nodes: a replica within a node (TP x PP <= node) shares a pod with others; a
    larger one spans ``ceil(TP x PP / node)`` whole-node pods (PP stages across nodes, Ray places them), which needs
    one replica's tensor-parallel group to fit on a node."""
    rollout, per_replica = config.rollout, layout.rollout_gpus_per_replica(config)
    if rollout.tensor_parallel_size > gpus_per_node:
        raise layout.LayoutError(
            f"rollout.tensor_parallel_size={rollout.tensor_parallel_size} exceeds the {gpus_per_node} GPUs of one "
            "node (--gpus-per-node): a tensor-parallel group must stay inside a node; raise "
            "rollout.pipeline_parallel_size and lower rollout.tensor_parallel_size instead"
        )
    if per_replica > gpus_per_node:
        hosts = -(-per_replica // gpus_per_node)
        return RayGroup("rollout", rollout.num_servers, hosts, gpus_per_node)
    per_pod = min(rollout.num_servers, gpus_per_node // per_replica)
    return RayGroup("rollout", -(-rollout.num_servers // per_pod), 1, per_pod * per_replica)


def trainer_group(config: RunConfig, gpus_per_node: int) -> RayGroup:
    pods = layout.trainer_pods(config, gpus_per_node)  # refuses more ranks per node than a node has GPUs
    return RayGroup("trainer", pods.num_pods, 1, pods.gpus_per_pod)


def _pod_spec(config: RunConfig, options: RenderOptions, role: str, gpus: int, ports: list[dict]) -> dict:
    parts = [config_volume(), model_volume(config, options), run_volume(options), shm_volume()]
    volumes, mounts = [volume for volume, _ in parts], [mount for _, mount in parts]
    if role == "coordinator":  # the coordinator reads the datasets
        data_vols, data_mounts = data_volumes(config, options)
        volumes, mounts = volumes + data_vols, mounts + data_mounts
    container = {
        "name": "ray-head" if role == "coordinator" else "ray-worker",
        "image": options.image,
        "imagePullPolicy": "IfNotPresent",
        "workingDir": options.workdir,
        "env": [field_env("POD_IP", "status.podIP"), field_env("POD_NAME", "metadata.name")],
        "ports": ports,
        "volumeMounts": mounts,
    }
    if gpus:
        container["resources"] = {"limits": {GPU_RESOURCE: gpus}}
    return {"containers": [container], "volumes": volumes}


def _template(config: RunConfig, options: RenderOptions, role: str, gpus: int, ports: list[dict], metrics: int):
    return {
        "metadata": {"labels": labels(config, role), "annotations": scrape_annotations(metrics)},
        "spec": _pod_spec(config, options, role, gpus, ports),
    }


def _worker(config: RunConfig, options: RenderOptions, group: RayGroup, metrics_port: int) -> dict:
    ports = [{"name": "metrics", "containerPort": metrics_port}]
    return {
        "groupName": group.role,
        "replicas": group.replicas,
        "minReplicas": group.replicas,
        "maxReplicas": group.replicas,  # fixed size; `fleetrl scale` changes replicas
        "numOfHosts": group.num_hosts,
        "rayStartParams": {},
        "resources": {"GPU": str(group.gpus_per_pod), f"fleetrl_{group.role}": str(group.gpus_per_pod)},
        "template": _template(config, options, group.role, group.gpus_per_pod, ports, metrics_port),
    }


def ray_cluster(config: RunConfig, options: RenderOptions, groups: list[RayGroup]) -> Manifest:
    cfg = config.coordinator
    head_ports = [
        {"name": "gcs-server", "containerPort": RAY_GCS_PORT},
        {"name": "dashboard", "containerPort": RAY_DASHBOARD_PORT},
        {"name": "client", "containerPort": RAY_CLIENT_PORT},
        {"name": "fleetrl-admin", "containerPort": cfg.admin_port},
        {"name": "metrics", "containerPort": cfg.metrics_port},
    ]
    if cfg.dashboard:
        head_ports.append({"name": "fleetrl-dash", "containerPort": cfg.dashboard_port})
    metrics_ports = {"rollout": layout.ROLLOUT_METRICS_PORT, "trainer": config.trainer.metrics_port}
    cluster = {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": metadata(config, cluster_name(config), "ray"),
        "spec": {
            "rayVersion": options.ray_version,
            "enableInTreeAutoscaling": False,
            "headGroupSpec": {
                "rayStartParams": {"dashboard-host": "0.0.0.0", "num-gpus": "0"},
                "resources": {"fleetrl_coordinator": "1"},
                "template": _template(config, options, "coordinator", 0, head_ports, cfg.metrics_port),
            },
            "workerGroupSpecs": [_worker(config, options, g, metrics_ports[g.role]) for g in groups],
        },
    }
    rollout, trainer = groups
    comment = [
        f"A Ray cluster for run {config.run_id} (KubeRay, ray.io/v1): a CPU head for the coordinator, and worker groups",
        f"rollout: {rollout.replicas} replicas x {rollout.num_hosts} pods x {rollout.gpus_per_pod} GPUs "
        f"({config.rollout.num_servers} servers of TP {config.rollout.tensor_parallel_size} x PP "
        f"{config.rollout.pipeline_parallel_size}); trainer: {trainer.num_pods} pods x {trainer.gpus_per_pod} GPUs.",
        "Custom Ray resources fleetrl_rollout / fleetrl_trainer / fleetrl_coordinator mark where each role goes.",
        f"The operator's head Service ({cluster_name(config)}-head-svc) exposes the head's ports: the Ray job API,",
        "the coordinator's admin API, dashboard and /metrics.",
    ]
    return Manifest("50-raycluster.yaml", comment, [cluster])


def ray_job(config: RunConfig, options: RenderOptions) -> Manifest:
    job = {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": metadata(config, dns_name(f"fleetrl-{config.run_id}-up"), "ray"),
        "spec": {
            "entrypoint": f"fleetrl up {RECIPE_PATH} --ray auto",
            "clusterSelector": {"ray.io/cluster": cluster_name(config)},
            "submissionMode": "K8sJobMode",
            "backoffLimit": options.backoff_limit,
        },
    }
    comment = [
        f"Runs `fleetrl up {RECIPE_PATH} --ray auto` on the RayCluster of 50-raycluster.yaml (clusterSelector):",
        "the launcher starts every role as Ray actors on the groups their custom resources name. The recipe is the",
        "resolved run config from the ConfigMap, mounted on every Ray pod.",
    ]
    return Manifest("60-rayjob.yaml", comment, [job])
