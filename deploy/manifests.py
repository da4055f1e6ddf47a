"""Kubernetes objects for one run: plain dicts, one builder per role, dumped by ``deploy.render``.

The building blocks (labels, volumes, containers) are ``deploy.k8s``; what each container runs is
``deploy.commands``.
"""

from __future__ import annotations

import yaml

from deploy import layout
from deploy.commands import WAIT_FOR_ROLLOUT, coordinator_command, rollout_addresses, rollout_command, trainer_command
from deploy.k8s import (
    CONFIG_MAP_NAME,
    CONFIG_PATH,
    Manifest,
    RenderOptions,
    config_volume,
    container,
    data_volumes,
    field_env,
    gpu_limits,
    headless_service,
    labels,
    metadata,
    model_volume,
    run_volume,
    scrape_annotations,
    shm_volume,
)
from protos.config import RunConfig


def config_map(config: RunConfig) -> Manifest:
    recipe = yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False, width=120)
    obj = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(config, CONFIG_MAP_NAME, "config"),
        "data": {"config.json": config.model_dump_json(indent=2), "recipe.yaml": recipe},
    }
    return Manifest(
        "00-config.yaml",
        [
            "The resolved run config (JSON): every role reads it as --config " + CONFIG_PATH + ";",
            "recipe.yaml holds the same as YAML (what `fleetrl up` takes, e.g. from the RayJob).",
            "Rendered from the recipe, the command-line overrides and the cluster settings (fixed ports, 0.0.0.0",
            "admin/dashboard interfaces, Redis Service URL, out_dir on the shared run volume).",
        ],
        [obj],
    )


def redis(config: RunConfig, options: RenderOptions) -> Manifest:
    role, port = "redis", 6379
    pod = {
        "containers": [
            {
                "name": "redis",
                "image": options.redis_image,
                # The image's entrypoint prepends the server binary to arguments that start with '--'.
                "args": ["--appendonly", "yes", "--dir", "/data"],
                "ports": [{"name": "redis", "containerPort": port}],
                "readinessProbe": {"tcpSocket": {"port": port}, "periodSeconds": 5},
                "volumeMounts": [{"name": "data", "mountPath": "/data"}],
            }
        ]
    }
    stateful_set = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata(config, "redis", role),
        "spec": {
            "serviceName": "redis",
            "replicas": 1,
            "selector": {"matchLabels": labels(config, role)},
            "template": {"metadata": {"labels": labels(config, role)}, "spec": pod},
            "volumeClaimTemplates": [
                {
                    "metadata": {"name": "data"},
                    "spec": {
                        "accessModes": ["ReadWriteOnce"],
                        "resources": {"requests": {"storage": options.redis_storage}},
                    },
                }
            ],
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(config, "redis", role),
        "spec": {"selector": labels(config, role), "ports": [{"name": "redis", "port": port}]},
    }
    return Manifest(
        "10-redis.yaml",
        [
            f"Redis (image {options.redis_image}): the trajectory stream, versions, fleet reports, metrics streams.",
            "Append-only file on a volume: the queue's exactly-once rule assumes Redis keeps acknowledged state",
            "across a restart of its pod. Not rendered when the config sets redis_url.",
        ],
        [stateful_set, service],
    )


def rollout(config: RunConfig, options: RenderOptions, pods: layout.RolePods) -> Manifest:
    role, port = "rollout", config.rollout.base_port
    volumes, mounts = zip(config_volume(), model_volume(config, options), shm_volume(), strict=False)
    volumes, mounts = list(volumes), list(mounts)
    if config.weight_bus.snapshot_dir:  # receivers load a version from the snapshot when the publisher is gone
        volume, mount = run_volume(options, read_only=True)
        volumes.append(volume)
        mounts.append(mount)
    main = container(
        options,
        "rollout",
        rollout_command(config),
        mounts,
        env=[field_env("POD_NAME", "metadata.name")],
        ports=[
            {"name": "grpc", "containerPort": port},
            {"name": "metrics", "containerPort": layout.ROLLOUT_METRICS_PORT},
        ],
        resources=gpu_limits(pods.gpus_per_pod),
        # Health turns SERVING only once the engine is up and the gRPC server listens.
        readinessProbe={"grpc": {"port": port}, "periodSeconds": 10, "failureThreshold": 3},
    )
    annotations = {}
    comment = [
        f"{pods.num_pods} rollout servers (vLLM TP {config.rollout.tensor_parallel_size} x PP "
        f"{config.rollout.pipeline_parallel_size}), {pods.gpus_per_pod} GPUs each; pods rollout-<i>.rollout."
    ]
    if layout.rollout_spans_nodes(config, options.gpus_per_node):
        note = (
            f"NOT SCHEDULABLE AS IS: a replica needs {pods.gpus_per_pod} GPUs, more than one node's "
            f"{options.gpus_per_node}. vLLM across nodes needs a Ray cluster per replica (e.g. a LeaderWorkerSet),"
            " which rollout_service does not start and this file does not render."
        )
        annotations["fleetrl/multi-node-rollout"] = note
        comment.append(note)
    template_meta = {"labels": labels(config, role), "annotations": scrape_annotations(layout.ROLLOUT_METRICS_PORT)}
    stateful_set = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata(config, layout.ROLLOUT_SERVICE, role, annotations),
        "spec": {
            "serviceName": layout.ROLLOUT_SERVICE,
            "replicas": pods.num_pods,
            "podManagementPolicy": "Parallel",  # every engine loads at once, not one by one
            "selector": {"matchLabels": labels(config, role)},
            "template": {"metadata": template_meta, "spec": {"containers": [main], "volumes": volumes}},
        },
    }
    return Manifest(
        "20-rollout.yaml", comment, [headless_service(config, layout.ROLLOUT_SERVICE, role, port), stateful_set]
    )


def trainer(config: RunConfig, options: RenderOptions, pods: layout.RolePods) -> Manifest:
    role = "trainer"
    volumes, mounts = zip(
        config_volume(), model_volume(config, options), run_volume(options), shm_volume(), strict=False
    )
    env = [
        field_env("POD_IP", "status.podIP"),
        field_env("NODE_RANK", "metadata.annotations['batch.kubernetes.io/job-completion-index']"),
    ]
    main = container(
        options,
        "trainer",
        trainer_command(config),
        list(mounts),
        env=env,
        ports=[
            {"name": "rdzv", "containerPort": layout.RDZV_PORT},
            {"name": "metrics", "containerPort": config.trainer.metrics_port},
        ],
        resources=gpu_limits(pods.gpus_per_pod),
    )
    template_meta = {"labels": labels(config, role), "annotations": scrape_annotations(config.trainer.metrics_port)}
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": metadata(config, layout.TRAINER_SERVICE, role),
        "spec": {
            "completionMode": "Indexed",
            "completions": pods.num_pods,
            "parallelism": pods.num_pods,
            "backoffLimit": options.backoff_limit,
            "template": {
                "metadata": template_meta,
                "spec": {
                    "subdomain": layout.TRAINER_SERVICE,  # pod hostnames trainer-<index>.trainer
                    "restartPolicy": "OnFailure",
                    "containers": [main],
                    "volumes": list(volumes),
                },
            },
        },
    }
    comment = [
        f"The trainer: {pods.num_pods} pods (an Indexed Job; pod i is trainer-i.trainer) x {pods.gpus_per_pod} GPUs,",
        "one torchrun per pod. The job completes when the trainer finishes its steps; a crashed pod restarts and",
        "resumes from the newest checkpoint (trainer.resume=latest).",
        f"Checkpoints: trainer.ckpt_dir (default out_dir/checkpoints) is on the run volume ({layout.RUN_VOLUME_PATH},",
        "ReadWriteMany): rank 0 prepares step-N.partial and every rank of every node writes its shard into that",
        "directory (docs/trainer_service.md, 'Several ranks'), so all trainer pods must see the same filesystem.",
        "Global rank 0 (Redis, weight publishing, trainer.metrics_port) is on whichever pod the c10d rendezvous",
        "gives it; the other pods' metrics port stays closed.",
        "NCCL hints (comments only; they depend on the fabric): if NCCL picks the wrong interface, set",
        "NCCL_SOCKET_IFNAME (and NCCL_IB_HCA for InfiniBand) in the container env; NCCL_DEBUG=INFO logs its choice.",
        "Pods with RDMA NICs may need the vendor's device-plugin resource requested next to nvidia.com/gpu.",
    ]
    return Manifest(
        "30-trainer.yaml", comment, [headless_service(config, layout.TRAINER_SERVICE, role, layout.RDZV_PORT), job]
    )


def coordinator(config: RunConfig, options: RenderOptions, addresses: list[str] | None = None) -> Manifest:
    """``addresses``: the rollout servers it dispatches to (default: the rollout StatefulSet's pods)."""
    role, cfg = "coordinator", config.coordinator
    addresses = rollout_addresses(config) if addresses is None else addresses
    volumes, mounts = (
        list(parts) for parts in zip(config_volume(), model_volume(config, options), run_volume(options), strict=False)
    )
    data_vols, data_mounts = data_volumes(config, options)
    ports = [{"name": "admin", "containerPort": cfg.admin_port}, {"name": "metrics", "containerPort": cfg.metrics_port}]
    if cfg.dashboard:
        ports.append({"name": "dashboard", "containerPort": cfg.dashboard_port})
    wait = container(
        options,
        "wait-for-rollout",
        ["python", "-c", WAIT_FOR_ROLLOUT, ",".join(addresses), str(options.rollout_ready_timeout_s)],
        [],
    )
    main = container(options, "coordinator", coordinator_command(config, addresses), mounts + data_mounts, ports=ports)
    template_meta = {"labels": labels(config, role), "annotations": scrape_annotations(cfg.metrics_port)}
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": metadata(config, "coordinator", role),
        "spec": {
            "completions": 1,
            "parallelism": 1,
            "backoffLimit": options.backoff_limit,
            "template": {
                "metadata": template_meta,
                "spec": {
                    "restartPolicy": "OnFailure",
                    "initContainers": [wait],
                    "containers": [main],
                    "volumes": volumes + data_vols,
                },
            },
        },
    }
    service_ports = [{"name": p["name"], "port": p["containerPort"]} for p in ports]
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(config, "coordinator", role),
        "spec": {"selector": labels(config, role), "ports": service_ports},
    }
    comment = [
        "The coordinator: one pod (a Job, not a Deployment: it exits 0 when every group is pushed, and a",
        "Deployment would restart it into a second pass over the dataset). Its Service exposes the admin API",
        "(fleetrl status --admin coordinator:<port>), the dashboard and /metrics.",
        "The init container waits for every rollout server's gRPC health (vLLM loads a large model for longer",
        "than the coordinator's own start-up wait).",
    ]
    return Manifest("40-coordinator.yaml", comment, [job, service])
