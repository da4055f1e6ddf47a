#!/usr/bin/env python
"""Trajectories/s through the trajectory stream's channel against raw Redis commands on the same bytes, side by side.

Run from the repository root::

    .venv/bin/python benchmarks/queue_throughput.py [--shapes 8x1024,8x32 --groups 400 --rounds 5]

For each group shape (samples x response tokens, with int32 token ids, float32 logprobs and one version span per
sample: what the coordinator pushes) one round moves ``--groups`` groups through an embedded valkey twice:

(a) ``channel``: ``TrajectoryStreamWriter.push`` of each group with its prompt cursor (encode + the exactly-once Lua
    step, what the coordinator does), then ``TrajectoryStreamReader.read`` of ``--batch`` groups at a time through
    the consumer group (XREADGROUP + decode) and ``ack`` (XACK + trim of acknowledged entries), what the trainer does;
(b) ``raw``: XADD of the same encoded bytes (asyncio client, as the writer), then XREADGROUP of ``--batch`` entries
    and XACK (sync client, as the reader), no encode, decode, cursor or trim.

Both sides start on a fresh stream and consumer group. Rounds alternate a, b, a, b, ... after one warm-up each; the
medians are compared. Each round also takes the CPU seconds of this process and of valkey (psutil): on a busy
machine the wall clock wanders with everyone else's load, the CPU spent per trajectory much less. The last line
printed is one JSON object with each shape's ``channel_traj_s``, ``raw_traj_s``, ``ratio`` (channel / raw wall-clock
throughput, medians; goal >= 0.8), ``best_ratio`` (the same of each side's fastest round: what is left when a round
is not slowed by other processes), ``cpu_ratio`` (raw CPU / channel CPU per trajectory, this process and valkey
together) and ``min_ratio`` (the lowest ``ratio``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import redis
import redis.asyncio as aioredis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from channels.trajectory_stream import TrajectoryStreamReader, TrajectoryStreamWriter  # noqa: E402
from launcher.redis_server import EmbeddedRedis  # noqa: E402
from protos.records import Array, PromptCursor, Sample, TrajectoryGroup, VersionSpan, encode  # noqa: E402
from protos.redis_keys import RedisKeys  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="8x1024,8x32", help="samples x response tokens of a group, comma-separated")
    parser.add_argument("--groups", type=int, default=400, help="groups per round")
    parser.add_argument("--batch", type=int, default=16, help="groups per read and ack (a training step's)")
    parser.add_argument("--rounds", type=int, default=9, help="measured rounds per side")
    parser.add_argument("--appendonly", action="store_true", help="valkey with its append-only file (fsync always)")
    return parser.parse_args(argv)


def make_groups(num_groups: int, num_samples: int, num_tokens: int) -> list[TrajectoryGroup]:
    rng = np.random.default_rng(0)
    groups = []
    for index in range(num_groups):
        samples = [
            Sample(
                response_token_ids=Array.from_numpy(rng.integers(0, 150000, num_tokens, dtype=np.int32)),
                rollout_logprobs=Array.from_numpy(-rng.random(num_tokens, dtype=np.float32)),
                version_spans=[VersionSpan(index // 16, 0, num_tokens)],
                finish_reason=2,
                reward=float(rng.random()),
                server_id=f"rollout-{index % 8}",
            )
            for _ in range(num_samples)
        ]
        prompt = Array.from_numpy(rng.integers(0, 150000, 128, dtype=np.int32))
        groups.append(TrajectoryGroup(f"p{index}-{index}", f"p{index}", prompt, samples, "bench", index, 0, 0.0))
    return groups


async def channel_round(url: str, keys: RedisKeys, groups: list[TrajectoryGroup], batch: int) -> float:
    """Seconds to push every group through the writer, then read, decode and ack them through the reader."""
    async_client, sync_client = aioredis.Redis.from_url(url), redis.Redis.from_url(url)
    writer = TrajectoryStreamWriter(async_client, keys)
    reader = TrajectoryStreamReader(sync_client, keys)  # creates the consumer group (not timed)
    started = time.perf_counter()
    for group in groups:
        await writer.push(group, PromptCursor("bench", group.group_id, {"draws": group.admission_index}))
    received = 0
    while received < len(groups):
        entries = reader.read(min(batch, len(groups) - received), timeout_s=10.0)  # it waits to fill what it asks
        if not entries:
            raise TimeoutError(f"channel side: {received} of {len(groups)} groups read")
        reader.ack([entry_id for entry_id, _ in entries])
        received += len(entries)
    seconds = time.perf_counter() - started
    await async_client.aclose()
    sync_client.close()
    return seconds


async def raw_round(url: str, keys: RedisKeys, payloads: list[bytes], batch: int) -> float:
    """Seconds to XADD the same encoded bytes, then XREADGROUP and XACK them (no encode, decode, cursor or trim)."""
    async_client, sync_client = aioredis.Redis.from_url(url), redis.Redis.from_url(url)
    sync_client.xgroup_create(keys.trajectories, keys.trainer_group, id="0", mkstream=True)
    started = time.perf_counter()
    for payload in payloads:
        await async_client.xadd(keys.trajectories, {"g": payload})
    received = 0
    while received < len(payloads):
        reply = sync_client.xreadgroup(
            keys.trainer_group, "trainer-0", {keys.trajectories: ">"}, count=batch, block=10000
        )
        entries = reply[0][1] if reply else []
        if not entries:
            raise TimeoutError(f"raw side: {received} of {len(payloads)} entries read")
        sync_client.xack(keys.trajectories, keys.trainer_group, *[entry_id for entry_id, _ in entries])
        received += len(entries)
    seconds = time.perf_counter() - started
    await async_client.aclose()
    sync_client.close()
    return seconds


def cpu_s(server: psutil.Process) -> float:
    """CPU seconds of this process (fine-grained) and of valkey (clock ticks, 10 ms)."""
    return time.process_time() + sum(server.cpu_times()[:2])


async def measure_shape(args: argparse.Namespace, server: EmbeddedRedis, num_samples: int, num_tokens: int) -> dict:
    groups = make_groups(args.groups, num_samples, num_tokens)
    payloads = [encode(group) for group in groups]
    trajectories, url = args.groups * num_samples, server.url
    rates: dict[str, list[float]] = {"channel": [], "raw": []}
    cpu_per_traj: dict[str, list[float]] = {"channel": [], "raw": []}
    server_process = psutil.Process(server.process.pid)
    cleaner = redis.Redis.from_url(url)
    for round_index in range(args.rounds + 1):  # round 0 warms both sides up and is not counted
        for side in ("channel", "raw"):
            keys = RedisKeys(f"queue-bench-{side}-{round_index}")
            cpu_before = cpu_s(server_process)
            if side == "channel":
                seconds = await channel_round(url, keys, groups, args.batch)
            else:
                seconds = await raw_round(url, keys, payloads, args.batch)
            cpu = cpu_s(server_process) - cpu_before
            cleaner.delete(keys.trajectories, keys.prompt_cursor)
            label = "warm-up" if round_index == 0 else f"round {round_index}"
            rate, cpu_us = trajectories / seconds, 1e6 * cpu / trajectories
            print(f"{num_samples}x{num_tokens} {label:8s} {side:7s} {rate:10.0f} traj/s {cpu_us:7.1f} CPU us/traj")
            if round_index:
                rates[side].append(rate)
                cpu_per_traj[side].append(cpu_us)
    cleaner.close()
    channel, raw = statistics.median(rates["channel"]), statistics.median(rates["raw"])
    channel_cpu, raw_cpu = statistics.median(cpu_per_traj["channel"]), statistics.median(cpu_per_traj["raw"])
    return {
        "channel_traj_s": round(channel, 1),
        "raw_traj_s": round(raw, 1),
        "ratio": round(channel / raw, 4),
        "best_ratio": round(max(rates["channel"]) / max(rates["raw"]), 4),
        "channel_cpu_us_per_traj": round(channel_cpu, 2),
        "raw_cpu_us_per_traj": round(raw_cpu, 2),
        "cpu_ratio": round(raw_cpu / channel_cpu, 4) if channel_cpu else None,  # None: too short to measure
        "group_bytes": len(payloads[0]),
    }


async def main_async(args: argparse.Namespace) -> dict:
    results = {}
    with EmbeddedRedis(appendonly=args.appendonly) as server:
        for shape in args.shapes.split(","):
            num_samples, num_tokens = (int(part) for part in shape.split("x"))
            results[shape] = await measure_shape(args, server, num_samples, num_tokens)
    return {
        "shapes": results,
        "min_ratio": min(result["ratio"] for result in results.values()),
        "groups": args.groups,
        "batch": args.batch,
        "rounds": args.rounds,
    }


def main(argv: list[str] | None = None) -> None:
    print(json.dumps(asyncio.run(main_async(parse_args(argv)))))


if __name__ == "__main__":
    main()
