#!/usr/bin/env python
"""How the coordinator scales with the number of rollout servers: 2 to 256 stand-ins, side by side in one run.

Run from the repository root (no vLLM, no GPU needed)::

    .venv/bin/python benchmarks/fleet_scale.py [--sizes 2,8,32,128,256 --trajectories 4000 --plot docs/fleet_scale.png]

For each size N: one embedded valkey (shared by the sizes, a run id per size), N stand-in rollout servers in one
process (``rollout_service.standin_fleet``: the real gRPC server and weight follower over the synthetic engine,
niced so the coordinator gets the CPU first), a light trainer (a thread: reads B groups through the consumer group,
acks them, publishes the next version with no tensors, which every stand-in follows and reports) and one real
coordinator process (``python -m coordinator run``, the echo task). The offered load is the same at every size:
at most (k + 1) x B groups are in flight (the admission bound), each sample decodes at ``--tokens-per-s``.

Measured in a window after ``--warmup-trajectories`` (a trajectory is one sample; a group holds ``--group-size``):

* the coordinator process's CPU seconds (user + system, psutil) per 1,000 trajectories pushed;
* admission + routing latency, p50 / p99, from the coordinator's histograms on /metrics (two scrapes; quantiles
  as PromQL's histogram_quantile): ``dispatch`` = admission -> first request sent, waits for a server at the group's
  version floor included; ``routing`` = the same without that wait (the coordinator's own time);
* queue push throughput: groups (and trajectories) pushed onto the trajectory stream per second;
* the admin API's status latency (``fleetrl status``'s GetStatus RPC, polled every ``--status-interval-s``);
* after the window, the coordinator's CPU per second while paused and idle (status still polled): the fixed cost of a
  fleet of that size, and ``work_cpu_s_per_1k_traj``, the window's CPU less that fixed cost for as many seconds.

The last line printed is one JSON object: per-size figures, ``cpu_ratio_max_vs_min`` (CPU per trajectory at the
largest size / at the smallest; goal <= 1.2), the same of the work alone, and ``routing_p99_ms_max`` (goal < 5 ms). ``--plot`` writes a PNG;
``--py-spy-dir`` records the coordinator during each window with py-spy (when installed) as collapsed stacks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import redis
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from channels.trajectory_stream import TrajectoryStreamReader  # noqa: E402
from channels.version_board import VersionBoard  # noqa: E402
from coordinator.latency import quantile  # noqa: E402
from launcher.redis_server import EmbeddedRedis, free_port  # noqa: E402
from protos.records import WeightManifest  # noqa: E402
from protos.redis_keys import RedisKeys  # noqa: E402
from rollout_service import standin_fleet  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="2,8,32,128,256", help="stand-in server counts, comma-separated")
    parser.add_argument("--trajectories", type=int, default=6000, help="trajectories measured per size")
    parser.add_argument("--rounds", type=int, default=1, help="rounds over the sizes (alternating order); medians")
    parser.add_argument("--warmup-trajectories", type=int, default=800, help="pushed before the window opens")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--groups-per-step", type=int, default=32, help="B: groups the light trainer takes per step")
    parser.add_argument("--max-staleness", type=int, default=1, help="k: (k + 1) x B groups in flight at most")
    parser.add_argument("--max-tokens", type=int, default=64, help="response tokens per sample")
    parser.add_argument("--tokens-per-s", type=float, default=200.0, help="decode speed of each synthetic sample")
    parser.add_argument("--status-interval-s", type=float, default=0.25)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="longest wait for one size's window")
    parser.add_argument("--plot", default="", help="write the figures as a PNG here")
    parser.add_argument("--py-spy-dir", default="", help="record the coordinator of each window with py-spy here")
    parser.add_argument("--keep-logs", action="store_true", help="keep the work directory (logs) and print it")
    return parser.parse_args(argv)


class LightTrainer(threading.Thread):
    """Takes B groups per step through the consumer group, acks them and publishes the next version (no tensors)."""

    def __init__(self, redis_url: str, keys: RedisKeys, groups_per_step: int):
        super().__init__(daemon=True, name=f"light-trainer-{keys.run_id}")
        self.redis_url, self.keys, self.groups_per_step = redis_url, keys, groups_per_step
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            client = redis.Redis.from_url(self.redis_url)
            reader = TrajectoryStreamReader(client, self.keys)
            board = VersionBoard(client, self.keys)
            board.init_version(0)
            version, held = 0, []
            while not self.stop.is_set():
                held += reader.read(self.groups_per_step - len(held), timeout_s=0.5)
                if len(held) < self.groups_per_step:
                    continue
                reader.ack([entry_id for entry_id, _ in held])
                held, version = [], version + 1
                board.publish_manifest(WeightManifest(version, [], [], "", "tcp", time.time()))
        except BaseException as error:  # noqa: BLE001 - reported by the benchmark's loop
            self.error = error


def coordinator_config(args: argparse.Namespace, redis_url: str, run_id: str) -> tuple[dict, int, int]:
    admin_port, metrics_port = free_port(), free_port()
    # Twice the window and its warm-up: it keeps producing past the window, which may open late (status polls).
    total = 2 * (args.warmup_trajectories + args.trajectories)
    steps = math.ceil(total / args.group_size / args.groups_per_step) + 4
    config = {
        "run_id": run_id,
        "redis_url": redis_url,
        "num_steps": steps,
        "groups_per_step": args.groups_per_step,
        "max_staleness": args.max_staleness,
        "coordinator": {
            "group_size": args.group_size,
            "sampling": {"max_tokens": args.max_tokens},
            "admin_port": admin_port,
            "metrics_port": metrics_port,
            "dashboard": False,
        },
    }
    return config, admin_port, metrics_port


def scrape_histograms(url: str) -> dict[str, list[tuple[float, int]]]:
    """The cumulative buckets of every ``*_latency_s`` histogram on /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    histograms = {}
    for family in text_string_to_metric_families(text):
        if family.type == "histogram" and family.name.endswith("_latency_s"):
            buckets = [(float(s.labels["le"]), int(s.value)) for s in family.samples if s.name.endswith("_bucket")]
            histograms[family.name] = sorted(buckets)
    return histograms


def window_quantiles(start: list[tuple[float, int]], end: list[tuple[float, int]]) -> tuple[float, float]:
    """(p50, p99) in ms of the observations between two scrapes of one histogram."""
    window = [(bound, count - before) for (bound, count), (_, before) in zip(end, start, strict=True)]
    return 1000 * quantile(0.5, window), 1000 * quantile(0.99, window)


class Snapshot:
    """What the window's edges record: time, CPU of the coordinator and of the fleet host, groups, histograms."""

    def __init__(self, coordinator: psutil.Process, fleet: psutil.Process, pushed: int, metrics_url: str):
        self.time_s = time.monotonic()
        self.coordinator_cpu_s = sum(coordinator.cpu_times()[:2])
        self.fleet_cpu_s = sum(fleet.cpu_times()[:2])
        self.pushed = pushed
        self.histograms = scrape_histograms(metrics_url)


async def watch_window(args, stub, coordinator, fleet, metrics_url: str, trainer: LightTrainer) -> dict:
    """Poll status until the window has passed; returns the window's figures."""
    from protos import admin_pb2 as admin_pb

    start = end = None
    status_s: list[float] = []
    target = args.warmup_trajectories + args.trajectories  # then counted from the window's opening
    deadline = time.monotonic() + args.timeout_s
    processes = psutil.Process(coordinator.pid), psutil.Process(fleet.process.pid)
    while end is None:
        if coordinator.poll() is not None or trainer.error is not None:
            raise RuntimeError(f"coordinator exited ({coordinator.returncode}) or trainer failed ({trainer.error})")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the window of {target} trajectories did not pass in {args.timeout_s}s")
        asked = time.perf_counter()
        reply = await stub.GetStatus(admin_pb.GetStatusRequest(), timeout=30)
        if start is not None:
            status_s.append(time.perf_counter() - asked)
        pushed = reply.groups_pushed * args.group_size
        if start is None and pushed >= args.warmup_trajectories:
            start = await asyncio.to_thread(Snapshot, *processes, reply.groups_pushed, metrics_url)
            target = pushed + args.trajectories
        elif start is not None and pushed >= target:
            end = await asyncio.to_thread(Snapshot, *processes, reply.groups_pushed, metrics_url)
        await asyncio.sleep(args.status_interval_s)
    return figures(args, start, end, status_s)


async def idle_cpu_ms_per_s(args, stub, coordinator: subprocess.Popen, seconds: float = 3.0) -> float:
    """The coordinator's CPU while it admits nothing (paused, its groups done; status still polled): what a fleet of
    this size costs it per second whatever the throughput (fleet refresh, health, reports, the admin API)."""
    from protos import admin_pb2 as admin_pb

    await stub.Pause(admin_pb.PauseRequest(), timeout=30)
    deadline = time.monotonic() + 120
    while (await stub.GetStatus(admin_pb.GetStatusRequest(), timeout=30)).groups_in_flight:
        if time.monotonic() > deadline:
            raise TimeoutError("the paused coordinator still had groups in flight after 120 s")
        await asyncio.sleep(0.1)
    process = psutil.Process(coordinator.pid)
    before, started = sum(process.cpu_times()[:2]), time.monotonic()
    while time.monotonic() - started < seconds:
        await stub.GetStatus(admin_pb.GetStatusRequest(), timeout=30)
        await asyncio.sleep(args.status_interval_s)
    return 1000 * (sum(process.cpu_times()[:2]) - before) / (time.monotonic() - started)


def figures(args, start: Snapshot, end: Snapshot, status_s: list[float]) -> dict:
    groups = end.pushed - start.pushed
    trajectories, seconds = groups * args.group_size, end.time_s - start.time_s
    dispatch = window_quantiles(
        start.histograms["coordinator_dispatch_latency_s"], end.histograms["coordinator_dispatch_latency_s"]
    )
    routing = window_quantiles(
        start.histograms["coordinator_routing_latency_s"], end.histograms["coordinator_routing_latency_s"]
    )
    status_ms = sorted(1000 * s for s in status_s)
    return {
        "trajectories": trajectories,
        "window_s": round(seconds, 2),
        "cpu_s_per_1k_traj": round(1000 * (end.coordinator_cpu_s - start.coordinator_cpu_s) / trajectories, 4),
        "fleet_host_cpu_s_per_1k_traj": round(1000 * (end.fleet_cpu_s - start.fleet_cpu_s) / trajectories, 4),
        "dispatch_p50_ms": round(dispatch[0], 3),
        "dispatch_p99_ms": round(dispatch[1], 3),
        "routing_p50_ms": round(routing[0], 3),
        "routing_p99_ms": round(routing[1], 3),
        "push_groups_per_s": round(groups / seconds, 1),
        "push_traj_per_s": round(trajectories / seconds, 1),
        "status_p50_ms": round(statistics.median(status_ms), 3),
        "status_p99_ms": round(status_ms[min(len(status_ms) - 1, int(0.99 * len(status_ms)))], 3),
        "status_calls": len(status_ms),
    }


def start_py_spy(args, pid: int, count: int, seconds: float) -> subprocess.Popen | None:
    if not args.py_spy_dir:
        return None
    binary = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    out = Path(args.py_spy_dir) / f"coordinator-{count}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    command = [binary, "record", "--pid", str(pid), "--rate", "250", "--format", "raw", "--nonblocking"]
    return subprocess.Popen([*command, "--duration", str(int(seconds)), "-o", str(out)], stdout=subprocess.DEVNULL)


async def measure_size(args, count: int, redis_url: str, workdir: Path, run_id: str) -> dict:
    """One size: stand-ins, light trainer, coordinator; the window's figures."""
    import grpc

    from protos import admin_pb2_grpc

    trainer = LightTrainer(redis_url, RedisKeys(run_id), args.groups_per_step)
    trainer.start()
    overrides = [f"rollout.synthetic.tokens_per_s={args.tokens_per_s}", "rollout.max_inflight_requests=100000"]
    fleet = standin_fleet.spawn(
        count, workdir / f"fleet-{count}.log", "--redis-url", redis_url, "--run-id", run_id, *overrides
    )
    coordinator = None
    try:
        addresses = await asyncio.to_thread(fleet.wait_serving, 300)
        psutil.Process(fleet.process.pid).nice(10)  # the coordinator, not the stand-ins, is what is measured
        config, admin_port, metrics_port = coordinator_config(args, redis_url, run_id)
        (workdir / f"run-{count}.yaml").write_text(yaml.safe_dump(config))
        command = [sys.executable, "-m", "coordinator", "run", "--config", str(workdir / f"run-{count}.yaml")]
        coordinator = subprocess.Popen(
            [*command, "--servers", ",".join(addresses)],
            stdout=open(workdir / f"coordinator-{count}.log", "wb"),  # noqa: SIM115 - the child holds it
            stderr=subprocess.STDOUT,
        )
        async with grpc.aio.insecure_channel(f"127.0.0.1:{admin_port}") as channel:
            stub = admin_pb2_grpc.CoordinatorAdminStub(channel)
            await channel_ready(channel, coordinator, workdir / f"coordinator-{count}.log")
            spy = start_py_spy(args, coordinator.pid, count, args.timeout_s)
            result = await watch_window(
                args, stub, coordinator, fleet, f"http://127.0.0.1:{metrics_port}/metrics", trainer
            )
            if spy is not None:
                spy.send_signal(signal.SIGINT)  # py-spy writes what it has on SIGINT
                spy.wait(timeout=60)
            idle_ms_per_s = await idle_cpu_ms_per_s(args, stub, coordinator)
        # The window's CPU less what the coordinator spends idle in as many seconds: the work that trajectories cost.
        idle_s_per_1k = idle_ms_per_s * result["window_s"] / result["trajectories"]
        return {
            "servers": count,
            **result,
            "idle_cpu_ms_per_s": round(idle_ms_per_s, 2),
            "work_cpu_s_per_1k_traj": round(result["cpu_s_per_1k_traj"] - idle_s_per_1k, 4),
        }
    finally:
        if coordinator is not None and coordinator.poll() is None:
            coordinator.terminate()
            coordinator.wait(timeout=60)
        trainer.stop.set()
        trainer.join(timeout=30)
        fleet.stop()


async def channel_ready(channel, coordinator: subprocess.Popen, log: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if coordinator.poll() is not None:
            raise RuntimeError(f"the coordinator exited: {log.read_text(errors='replace')[-3000:]}")
        try:
            await asyncio.wait_for(channel.channel_ready(), timeout=1.0)
            return
        except TimeoutError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the coordinator's admin API did not come up in {timeout_s}s") from None


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["servers"] for r in results]
    panels = (
        (
            "coordinator CPU s / 1k trajectories",
            [("cpu_s_per_1k_traj", "all"), ("work_cpu_s_per_1k_traj", "less its idle cost")],
        ),
        (
            "admission -> dispatch latency (ms)",
            [(f"{w}_{q}_ms", f"{w} {q}") for w in ("routing", "dispatch") for q in ("p50", "p99")],
        ),
        ("queue push throughput", [("push_traj_per_s", "trajectories/s")]),
        ("admin status latency (ms)", [("status_p50_ms", "p50"), ("status_p99_ms", "p99")]),
    )
    figure, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for axis, (title, series) in zip(axes.flat, panels, strict=True):
        for key, label in series:
            axis.plot(sizes, [r[key] for r in results], marker="o", label=label)
        axis.set_xscale("log", base=2)
        axis.set_xticks(sizes, [str(s) for s in sizes])
        axis.set_xlabel("rollout servers (stand-ins)")
        axis.set_title(title)
        if title.endswith("(ms)"):  # waits for a server at a new version are 100x the routing time
            axis.set_yscale("log")
        else:
            axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle("fleetrl coordinator vs fleet size (benchmarks/fleet_scale.py)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


async def main_async(args: argparse.Namespace) -> dict:
    sizes = [int(size) for size in args.sizes.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="fleetrl-fleet-scale-"))
    measured: dict[int, list[dict]] = {count: [] for count in sizes}
    with EmbeddedRedis(appendonly=False) as redis_server:
        for round_index in range(args.rounds):
            for count in sizes if round_index % 2 == 0 else sizes[::-1]:  # drifting machine load hits both ends
                result = await measure_size(args, count, redis_server.url, workdir, f"fleet-{count}-r{round_index}")
                print(f"round {round_index + 1} " + " ".join(f"{k}={v}" for k, v in result.items()), flush=True)
                measured[count].append(result)
    results = [
        {key: statistics.median(r[key] for r in measured[count]) for key in measured[count][0]} for count in sizes
    ]
    if args.keep_logs:
        print(f"logs in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.plot:
        plot(results, args.plot)
    smallest, largest = results[0], results[-1]
    return {
        "sizes": sizes,
        "results": results,
        "cpu_ratio_max_vs_min": round(largest["cpu_s_per_1k_traj"] / smallest["cpu_s_per_1k_traj"], 3),
        "work_cpu_ratio_max_vs_min": round(largest["work_cpu_s_per_1k_traj"] / smallest["work_cpu_s_per_1k_traj"], 3),
        "idle_cpu_ms_per_s": {r["servers"]: r["idle_cpu_ms_per_s"] for r in results},
        "routing_p99_ms_max": max(r["routing_p99_ms"] for r in results),
        "dispatch_p99_ms_max": max(r["dispatch_p99_ms"] for r in results),
        "status_p99_ms_at_max": largest["status_p99_ms"],
        "rounds": args.rounds,
        "cpus": os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> None:
    print(json.dumps(asyncio.run(main_async(parse_args(argv)))))


if __name__ == "__main__":
    main()
