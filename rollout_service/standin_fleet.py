"""``python -m rollout_service.standin_fleet --count N``: N stand-in rollout servers in one asyncio process.

Each is a full rollout server over the synthetic engine (``rollout.engine=synthetic``, ``synthetic_engine.py``):
its own gRPC port (health, reflection, validation, backpressure), its own server id (``<prefix>-<i>``) and, with
``--redis-url``, its own weight follower that reads the run's announcements and manifests and reports versions to
the fleet hash. They share one event loop and one Redis client, so hundreds fit on a 2-core machine: what the
coordinator's fleet-scale benchmark (``benchmarks/fleet_scale.py``) and tests run against.

``--address-file PATH`` receives the servers' ``host:port`` lines (in server order) once all of them serve. SIGTERM
or SIGINT drains every server at once (``server.drain_and_stop``) and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from protos.config import flag_overrides, load_run_config
from rollout_service.__main__ import make_follower, start_following, write_address_file

logger = logging.getLogger("rollout_service.standin_fleet")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rollout_service.standin_fleet", description=__doc__)
    parser.add_argument("--count", type=int, required=True, help="stand-in servers to host")
    parser.add_argument("--host", default=None, help="alias of the config key rollout.host")
    parser.add_argument("--base-port", type=int, default=0, help="server i binds base + i; 0 = free ports")
    parser.add_argument("--address-file", default="", help="write the servers' host:port lines here once serving")
    parser.add_argument("--config", default=None, help="run config (YAML/JSON); its rollout/weight_bus sections apply")
    parser.add_argument("--id-prefix", default="standin", help="server ids are <prefix>-<i>")
    parser.add_argument("--redis-url", default=None, help="follow weight announcements of this Redis (redis_url)")
    parser.add_argument("--run-id", default=None, help="run namespace in Redis (alias of the config key run_id)")
    parser.add_argument("--grace-s", type=float, default=5.0, help="shutdown grace period for in-flight calls")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.synthetic.tokens_per_s=500")
    args = parser.parse_intermixed_args(argv)
    if args.count <= 0:
        parser.error(f"--count must be > 0 (got {args.count})")
    return args


def load_config(args: argparse.Namespace):
    """The run config with ``rollout.engine=synthetic`` (a vLLM engine in this process is refused)."""
    flags = {"redis_url": args.redis_url, "run_id": args.run_id, "rollout.host": args.host}
    run_config = load_run_config(args.config, ["rollout.engine=synthetic", *flag_overrides(flags), *args.overrides])
    if run_config.rollout.engine != "synthetic":
        raise SystemExit("standin_fleet hosts synthetic engines only: drop rollout.engine=vllm")
    return run_config


@dataclass
class StandinServer:
    """One hosted server: engine, servicer, gRPC server, health servicer and (optional) weight follower."""

    engine: object  # rollout_service.synthetic_engine.SyntheticEngine
    servicer: object  # rollout_service.server.RolloutServicer
    server: object  # grpc.aio.Server
    health: object  # grpc_health.v1.health.aio.HealthServicer
    address: str


@dataclass
class StandinFleet:
    """N stand-in servers in the running event loop; ``start`` then ``stop``."""

    run_config: object  # protos.config.RunConfig
    count: int
    base_port: int = 0
    id_prefix: str = "standin"
    servers: list[StandinServer] = field(default_factory=list)
    follow_tasks: list[asyncio.Task] = field(default_factory=list)
    _client: object = None  # the followers' shared redis.asyncio client

    @property
    def addresses(self) -> list[str]:
        return [server.address for server in self.servers]

    async def start(self, stop: asyncio.Event) -> list[str]:
        """Start every server (gRPC serving, first version report made), then their followers; returns addresses."""
        from rollout_service.server import RolloutServicer, start_grpc_server
        from rollout_service.synthetic_engine import SyntheticEngine

        config, host = self.run_config, self.run_config.rollout.host
        if config.redis_url:
            import redis.asyncio as aioredis

            # Each follower's blocking announcement read holds a connection, and its reports need another now and
            # then: the pool must allow more than one per server (redis-py's default cap is 100).
            self._client = aioredis.Redis.from_url(
                config.redis_url, socket_timeout=30, max_connections=2 * self.count + 16
            )
        for index in range(self.count):
            engine = SyntheticEngine(config.model_path, config.rollout, server_id=f"{self.id_prefix}-{index}")
            await engine.start()
            follower = make_follower(config, engine, "", client=self._client)
            servicer = RolloutServicer(engine, follower)
            port = self.base_port + index if self.base_port else 0
            server, bound, health = await start_grpc_server(servicer, host, port)
            address = f"{host}:{bound}"
            self.servers.append(StandinServer(engine, servicer, server, health, address))
            if follower is not None:
                follower.address = address
                await follower.report()
        for server in self.servers:
            self.follow_tasks += start_following(server.servicer.follower, config.rollout, stop)
        logger.info("%d stand-in servers serving (%s ... %s)", self.count, self.addresses[0], self.addresses[-1])
        return self.addresses

    async def stop(self, grace_s: float) -> None:
        """Drain every server at once, then wait for the followers (each checks ``stop`` at least every second)."""
        from rollout_service.server import drain_and_stop

        await asyncio.gather(*(drain_and_stop(s.server, s.servicer, s.health, grace_s) for s in self.servers))
        for task in self.follow_tasks:
            if not task.done():
                await asyncio.wait_for(task, timeout=10.0)
        for server in self.servers:
            server.engine.shutdown()
        if self._client is not None:
            await self._client.aclose()


async def run(args: argparse.Namespace) -> None:
    run_config = load_config(args)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # 1) start the servers (each serving and reported) and their weight followers
    fleet = StandinFleet(run_config, args.count, args.base_port, args.id_prefix)
    addresses = await fleet.start(stop)
    gc.freeze()  # the servers live as long as the process: keep them out of the collector's full passes
    # 2) tell the launcher where they are
    if args.address_file:
        write_address_file(args.address_file, "\n".join(addresses) + "\n")
    # 3) wait for a stop signal; a dead follower stops the fleet with its error
    waiter = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({waiter, *fleet.follow_tasks}, return_when=asyncio.FIRST_COMPLETED)
    # 4) drain every server, stop the followers
    stop.set()
    logger.info("draining %d stand-in servers (grace %.1fs)", args.count, args.grace_s)
    await fleet.stop(args.grace_s)
    # 5) a follower that died is the fleet's error
    for task in fleet.follow_tasks:
        if task in done and not task.cancelled() and task.exception():
            raise task.exception()
    logger.info("%d stand-in servers stopped", args.count)


@dataclass
class StandinFleetProcess:
    """A ``standin_fleet`` process started by ``spawn`` (benchmarks, tests): wait for its addresses, stop it."""

    process: subprocess.Popen
    log_path: Path
    address_file: Path
    addresses: list[str] = field(default_factory=list)

    def wait_serving(self, timeout_s: float = 120.0) -> list[str]:
        """Wait until every server serves (the address file is written after the last one); returns addresses."""
        deadline = time.monotonic() + timeout_s
        while not self.address_file.exists():
            if self.process.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"standin_fleet exited with {self.process.returncode}: {tail}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"standin_fleet wrote no addresses to {self.address_file} within {timeout_s}s")
            time.sleep(0.1)
        self.addresses = self.address_file.read_text().split()
        return self.addresses

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (the servers drain), SIGKILL after ``timeout_s``; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def spawn(count: int, log_path: Path, *args: str, env: dict[str, str] | None = None) -> StandinFleetProcess:
    """Start ``python -m rollout_service.standin_fleet --count COUNT ARGS`` (not waited for), logging to
    ``log_path``; its addresses go to ``log_path`` with the suffix ``.addresses``."""
    address_file = Path(log_path).with_suffix(".addresses")
    address_file.unlink(missing_ok=True)
    command = [sys.executable, "-m", "rollout_service.standin_fleet", "--count", str(count)]
    process = subprocess.Popen(
        [*command, "--address-file", str(address_file), *args],
        stdout=open(log_path, "wb"),  # noqa: SIM115 - the child holds it
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )
    return StandinFleetProcess(process, Path(log_path), address_file)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s standin %(levelname)s %(name)s: %(message)s")
    logging.getLogger("rollout_service.weight_sync").setLevel(logging.WARNING)  # one commit line per server per version
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import uvloop

    uvloop.run(run(args))


if __name__ == "__main__":
    main()
