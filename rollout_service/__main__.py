"""``python -m rollout_service serve``: one rollout server (vLLM engine, or the synthetic stand-in, + gRPC + weight
follower)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path
from typing import NoReturn

from protos.config import RolloutConfig, WeightBusConfig, flag_overrides, load_run_config
from protos.redis_keys import RedisKeys

logger = logging.getLogger("rollout_service")
REGISTER_TIMEOUT_S = 300.0  # how long a started server retries its first fleet report through an outage


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fleetrl rollout serve", description=__doc__)
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("--model", default=None, help="HF checkpoint directory (alias of the config key model_path)")
    parser.add_argument("--host", default=None, help="alias of the config key rollout.host")
    parser.add_argument("--port", type=int, default=50051, help="gRPC port; 0 = a free one (see --address-file)")
    parser.add_argument(
        "--address-file",
        default="",
        help="write host:port here once serving (how a launcher learns the port of --port 0)",
    )
    parser.add_argument("--config", default=None, help="run config (YAML/JSON); its rollout/weight_bus sections apply")
    parser.add_argument("--server-id", default="")
    parser.add_argument("--redis-url", default=None, help="follow weight announcements of this Redis (redis_url)")
    parser.add_argument("--run-id", default=None, help="run namespace in Redis (alias of the config key run_id)")
    parser.add_argument("--metrics-port", type=int, default=0, help="Prometheus port; 0 = off")
    parser.add_argument("--grace-s", type=float, default=5.0, help="shutdown grace period for in-flight calls")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.max_model_len=512")
    return parser.parse_intermixed_args(argv)


def write_address_file(path: str, address: str) -> None:
    """Atomically (write, then rename): a reader never sees a half-written address."""
    partial = Path(f"{path}.partial")
    partial.write_text(address)
    partial.rename(path)


async def watch_engine(engine, stop: asyncio.Event, interval_s: float = 1.0) -> None:
    """Raise once the vLLM engine core died: a server that cannot generate must exit, not linger."""
    while not stop.is_set():
        if engine.errored:
            why = getattr(engine, "failure", "") or "vLLM engine core died"
            raise RuntimeError(f"rollout server {engine.server_id}: {why}")
        await asyncio.sleep(interval_s)


def load_config(args: argparse.Namespace):
    """The resolved run config: the file, then the flags (config aliases), then the dotted overrides."""
    from protos.config import describe_config_error

    flags = {"model_path": args.model, "redis_url": args.redis_url, "run_id": args.run_id, "rollout.host": args.host}
    try:
        run_config = load_run_config(args.config, [*flag_overrides(flags), *args.overrides])
    except ValueError as error:
        _user_error(f"invalid config: {describe_config_error(error)}")
    if run_config.rollout.engine == "vllm":  # the synthetic stand-in needs no model
        if not run_config.model_path:
            _user_error("model_path must be set (the config key, or --model)")
        if not Path(run_config.model_path).is_dir():
            _user_error(f"model_path {run_config.model_path} is not a directory (an HF checkpoint directory)")
    return run_config


def _user_error(message: str) -> NoReturn:
    """A user's mistake: one line on stderr, exit 2, no traceback."""
    print(f"fleetrl rollout serve: {message}", file=sys.stderr)
    raise SystemExit(2)


def make_engine(run_config, server_id: str):
    """The engine ``rollout.engine`` names: vLLM on ``model_path``, or the synthetic stand-in (which imports no vLLM
    and needs no model)."""
    if run_config.rollout.engine == "synthetic":
        from rollout_service.synthetic_engine import SyntheticEngine

        return SyntheticEngine(run_config.model_path, run_config.rollout, server_id=server_id)
    from rollout_service.engine import RolloutEngine

    return RolloutEngine(run_config.model_path, run_config.rollout, server_id=server_id)


def make_follower(run_config, engine, address: str, client=None):
    """The weight follower on the run's Redis rendezvous; None without ``redis_url`` (the weights stay).

    ``client``: an asyncio Redis client to share (the stand-in fleet's servers share one); None = its own.
    """
    if not run_config.redis_url:
        return None
    import redis.asyncio as aioredis

    from rollout_service.weight_sync import WeightFollower

    bus_config: WeightBusConfig = run_config.weight_bus
    client = client or aioredis.Redis.from_url(run_config.redis_url, socket_timeout=30)
    keys = RedisKeys(run_config.run_id)
    broadcasts = None  # an engine that loads no bytes takes no part in NCCL broadcasts
    if engine.loads_weight_bytes:
        broadcasts = nccl_subscriber_factory(run_config.redis_url, keys, bus_config, engine.server_id)
    return WeightFollower(engine, client, keys, bus_config, address, nccl_subscriber_factory=broadcasts)


async def announce(args: argparse.Namespace, engine, follower, host: str, port: int) -> None:
    """Once the gRPC server listens: metrics, the address file, and the follower's first fleet report."""
    from rollout_service import metrics

    metrics.track_engine(engine)
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr=host)
    logger.info("rollout server %s serving on %s:%d", engine.server_id, host, port)
    if args.address_file:  # after the bind: a port chosen by a launcher ahead of time could be taken meanwhile
        write_address_file(args.address_file, f"{host}:{port}")
    if follower is not None:
        from channels.retry import retry_async

        follower.address = f"{host}:{port}"
        # the registration that routes calls here: a Redis outage at this moment must not end a server whose engine
        # just started (the long chaos soak lost one so); the report is idempotent, so it is retried
        await retry_async(follower.report, f"server {engine.server_id}: first fleet report", REGISTER_TIMEOUT_S)


def start_following(follower, rollout_config: RolloutConfig, stop: asyncio.Event) -> list[asyncio.Task]:
    """The follower's background tasks (``weight_updates == "follow"``): announcements, and NCCL broadcasts."""
    if follower is None or rollout_config.weight_updates != "follow":
        return []
    tasks = [asyncio.create_task(follower.run(stop), name="weight-follower")]
    if follower.nccl_subscriber_factory is not None:
        tasks.append(asyncio.create_task(follower.follow_broadcasts(stop), name="nccl-receiver"))
    return tasks


async def run(args: argparse.Namespace) -> None:
    from rollout_service.heartbeat import deregister, start_heartbeat
    from rollout_service.metrics import start_reporting
    from rollout_service.server import RolloutServicer, drain_and_stop, start_grpc_server

    run_config = load_config(args)
    host, rollout_config = run_config.rollout.host, run_config.rollout
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    # 1) start the engine (vLLM, or the synthetic stand-in)
    engine = make_engine(run_config, args.server_id)
    await engine.start()
    # 2) connect the weight bus (Redis rendezvous) if asked, and catch up to the latest version
    follower = make_follower(run_config, engine, f"{host}:{args.port}")
    # 3) serve gRPC (health turns SERVING only now), then announce the address, follow new versions and report
    servicer = RolloutServicer(engine, follower)
    server, port, health_servicer = await start_grpc_server(servicer, host, args.port)
    await announce(args, engine, follower, host, port)
    follow_tasks = start_following(follower, rollout_config, stop) + start_reporting(servicer, follower, stop)
    follow_tasks += start_heartbeat(follower, rollout_config.heartbeat_interval_s, stop)
    # 4) wait for a stop signal; a dead follower task or a dead engine stops the server with an error
    waiter = asyncio.create_task(stop.wait())
    watchdog = asyncio.create_task(watch_engine(engine, stop), name="engine-watchdog")
    done, _ = await asyncio.wait({waiter, watchdog, *follow_tasks}, return_when=asyncio.FIRST_COMPLETED)
    # 5) graceful shutdown: NOT_SERVING, refuse new calls, give in-flight calls the grace period, stop the engine
    stop.set()
    await deregister(follower)  # first: the coordinator stops sending new calls while these drain
    logger.info("rollout server %s draining %d calls (grace %.1fs)", engine.server_id, servicer.inflight, args.grace_s)
    await drain_and_stop(server, servicer, health_servicer, args.grace_s)
    for task in follow_tasks:
        if not task.done():
            await asyncio.wait_for(task, timeout=10.0)  # each checks `stop` at least every second
    engine.shutdown()
    logger.info("rollout server %s stopped", engine.server_id)
    watchdog.cancel()
    # 6) a background task that died is the server's error
    for task in (*follow_tasks, watchdog):
        if task in done and not task.cancelled() and task.exception():
            raise task.exception()


def nccl_subscriber_factory(redis_url: str, keys: RedisKeys, config: WeightBusConfig, server_id: str):
    """transport 'nccl': how this server joins the trainer's broadcast group (one rank on the engine's GPU);
    None for the other transports. Refused without a GPU: NCCL has no CPU ranks."""
    if config.transport != "nccl":
        return None
    import torch

    if not torch.cuda.is_available():
        raise ValueError(
            "weight_bus.transport='nccl' needs a GPU in every rollout server (one NCCL rank each); "
            "use weight_bus.transport='tcp' on CPU machines"
        )

    def make():
        import redis

        from weight_bus.nccl import NcclWeightSubscriber

        return NcclWeightSubscriber(
            redis.Redis.from_url(redis_url, socket_timeout=30),
            keys,
            config,
            server_id,
            torch.device("cuda", torch.cuda.current_device()),
        )

    return make


def exit_after_stop(code: int) -> NoReturn:
    """Leave once the server has stopped (calls drained, engine shut down) or failed (logged), without the
    interpreter's teardown: its garbage collection over the objects of vLLM, torch and transformers took 9-10 s on a
    busy 2-core machine, longer than a launcher's stop grace, so every stop ended in a SIGKILL and every restart of a
    failed server waited for it."""
    logging.shutdown()  # flushes the log handlers: nothing the server wrote is lost
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rollout %(levelname)s %(name)s: %(message)s")
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        import uvloop

        uvloop.run(run(args))
    except KeyboardInterrupt:
        pass
    except Exception:  # a user's mistake (SystemExit) still exits the usual way, with its one line
        logger.exception("rollout server %s failed", args.server_id)
        exit_after_stop(1)
    exit_after_stop(0)


if __name__ == "__main__":
    main()
