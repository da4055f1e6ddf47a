"""Kubernetes objects for one run: plain dicts, one builder per role, dumped by ``deploy.render``.

Every role pod runs the image's ``python -m <role>`` with ``--config CONFIG_DIR/config.json`` from the run's
ConfigMap and ``--model model_path`` from the read-only model volume, exactly as ``coordinator/launcher.py`` starts
the roles on one machine.
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


# Objects ----------------------------------------------------------------------------------------------------------
def config_map(config: RunConfig) -> Manifest:
    obj = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(config, CONFIG_MAP_NAME, "config"),
        "data": {"config.json": config.model_dump_json(indent=2)},
    }
    return Manifest(
        "00-config.yaml",
        [
            "The resolved run config (JSON): every role reads it as --config " + CONFIG_PATH + ".",
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


def rollout_addresses(config: RunConfig) -> list[str]:
    """The coordinator's --servers: each StatefulSet pod's DNS name (rollout-<i>.rollout) and gRPC port."""
    port = config.rollout.base_port
    return [f"{layout.ROLLOUT_SERVICE}-{i}.{layout.ROLLOUT_SERVICE}:{port}" for i in range(config.rollout.num_servers)]


def rollout_command(config: RunConfig) -> list[str]:
    # --host is the pod's own DNS name, not 0.0.0.0: the server binds it (the pod IP) and reports it to Redis as
    # its address, and the coordinator matches those reports to its --servers entries by address to learn each
    # server's policy version. With 0.0.0.0 the reports would say 0.0.0.0:<port>, match nothing, and dispatch would
    # stall once the staleness bound needs newer versions.
    return [
        "python",
        "-m",
        "rollout_service",
        "serve",
        "--model",
        config.model_path,
        "--host",
        f"$(POD_NAME).{layout.ROLLOUT_SERVICE}",
        "--port",
        str(config.rollout.base_port),
        "--server-id",
        "$(POD_NAME)",
        "--redis-url",
        config.redis_url,
        "--config",
        CONFIG_PATH,
        "--metrics-port",
        str(layout.ROLLOUT_METRICS_PORT),
    ]


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


def trainer_command(config: RunConfig) -> list[str]:
    """The launcher's trainer command for one node; torchrun with a c10d rendezvous on trainer-0 for several."""
    tcfg = config.trainer
    # weight_bus.host: rank 0 advertises the address it binds in every manifest; the pod IP reaches it from the
    # rollout pods (0.0.0.0 would be advertised as is, and 127.0.0.1 is unreachable).
    role = [
        "-m",
        "trainer_service",
        "train",
        "--model",
        config.model_path,
        "--redis-url",
        config.redis_url,
        "--config",
        CONFIG_PATH,
        "weight_bus.host=$(POD_IP)",
    ]
    if tcfg.num_nodes == 1 and tcfg.num_processes == 1:
        return ["python", *role]
    if tcfg.num_nodes == 1:
        ranks = ["--standalone", "--nproc-per-node", str(tcfg.num_processes)]
    else:
        ranks = [
            "--nnodes",
            str(tcfg.num_nodes),
            "--nproc-per-node",
            str(tcfg.num_processes),
            "--node-rank",
            "$(NODE_RANK)",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"{layout.TRAINER_SERVICE}-0.{layout.TRAINER_SERVICE}:{layout.RDZV_PORT}",
            "--rdzv-id",
            config.run_id,
        ]
    return ["python", "-m", "torch.distributed.run", *ranks, *role]


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


# Waits for every rollout server's gRPC health to say SERVING (vLLM loading a large model takes far longer than the
# coordinator's own 300 s wait). argv: servers (comma-separated), timeout in seconds.
WAIT_FOR_ROLLOUT = """\
import sys, time, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
servers, timeout_s = sys.argv[1].split(","), float(sys.argv[2])
deadline = time.monotonic() + timeout_s
for address in servers:
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))
    while True:
        try:
            if stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == 1:
                break
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            sys.exit(f"rollout server {address} not SERVING after {timeout_s:.0f}s")
        print(f"waiting for rollout server {address} (gRPC health SERVING)", flush=True)
        time.sleep(15)
"""


def coordinator_command(config: RunConfig) -> list[str]:
    return [
        "python",
        "-m",
        "coordinator",
        "run",
        "--servers",
        ",".join(rollout_addresses(config)),
        "--redis-url",
        config.redis_url,
        "--model",
        config.model_path,
        "--config",
        CONFIG_PATH,
    ]


def coordinator(config: RunConfig, options: RenderOptions) -> Manifest:
    role, cfg = "coordinator", config.coordinator
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
        ["python", "-c", WAIT_FOR_ROLLOUT, ",".join(rollout_addresses(config)), str(options.rollout_ready_timeout_s)],
        [],
    )
    main = container(options, "coordinator", coordinator_command(config), mounts + data_mounts, ports=ports)
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
