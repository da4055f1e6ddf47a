"""What each role's pod runs: the container argv of the rollout servers, the trainer and the coordinator.

Every role runs the image's ``python -m <role>`` with ``--config CONFIG_PATH`` from the run's ConfigMap and
``--model model_path`` from the read-only model volume, as ``launcher/demo.py`` starts the roles on one
machine; the trainer's argv comes from the builder both share (``protos.trainer_command``).
"""

from __future__ import annotations

from deploy import layout
from deploy.k8s import CONFIG_PATH
from protos.config import RunConfig
from protos.trainer_command import Rendezvous, trainer_argv


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


def trainer_role_args(config: RunConfig) -> list[str]:
    """The trainer's own flags in a pod (what follows ``trainer_service train``)."""
    # weight_bus.host: rank 0 advertises the address it binds in every manifest; the pod IP reaches it from the
    # rollout pods (0.0.0.0 would be advertised as is, and 127.0.0.1 is unreachable).
    return [
        "--model",
        config.model_path,
        "--redis-url",
        config.redis_url,
        "--config",
        CONFIG_PATH,
        "weight_bus.host=$(POD_IP)",
    ]


def trainer_command(config: RunConfig) -> list[str]:
    """The launcher's trainer command for one node; torchrun with a c10d rendezvous on trainer-0 for several."""
    rendezvous = Rendezvous(
        endpoint=f"{layout.TRAINER_SERVICE}-0.{layout.TRAINER_SERVICE}:{layout.RDZV_PORT}",
        node_rank="$(NODE_RANK)",
        run_id=config.run_id,
    )
    return ["python", *trainer_argv(config, trainer_role_args(config), rendezvous)]


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


def coordinator_command(config: RunConfig, addresses: list[str] | None = None) -> list[str]:
    """``addresses``: the rollout servers (default: the rollout StatefulSet's pods)."""
    return [
        "python",
        "-m",
        "coordinator",
        "run",
        "--servers",
        ",".join(rollout_addresses(config) if addresses is None else addresses),
        "--redis-url",
        config.redis_url,
        "--model",
        config.model_path,
        "--config",
        CONFIG_PATH,
    ]
