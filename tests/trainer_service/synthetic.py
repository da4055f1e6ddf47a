"""Synthetic trajectory groups for trainer tests: real token ids of the tiny vocabulary, varied lengths."""

from __future__ import annotations

import numpy as np

from protos.records import Array, FinishReason, Sample, TrajectoryGroup, VersionSpan


def make_group(index: int, version: int = 0, group_size: int = 4, seed: int = 0) -> TrajectoryGroup:
    """Group ``g<index>``: a prompt of 3-6 tokens, responses of 2-9 tokens, rewards in {0, 1}."""
    rng = np.random.default_rng(seed * 100_003 + index)
    prompt = np.concatenate([[1], rng.integers(3, 13, rng.integers(2, 6))]).astype(np.int32)
    samples = []
    for _ in range(group_size):
        length = int(rng.integers(2, 10))
        response = rng.integers(3, 64, length).astype(np.int32)
        logprobs = -rng.uniform(0.5, 4.0, length).astype(np.float32)
        samples.append(
            Sample(
                Array.from_numpy(response),
                Array.from_numpy(logprobs),
                [VersionSpan(version, 0, length)],
                FinishReason.LENGTH,
                float(rng.integers(0, 2)),
            )
        )
    return TrajectoryGroup(
        f"g{index}", f"p{index}", Array.from_numpy(prompt), samples, "synthetic", index, version, 0.0
    )


def with_nonfinite_rewards(group: TrajectoryGroup) -> TrajectoryGroup:
    """``group`` with NaN rewards (a broken reward function): the step that trains it has a non-finite loss and is
    skipped."""
    import msgspec

    return msgspec.structs.replace(
        group, samples=[msgspec.structs.replace(s, reward=float("nan")) for s in group.samples]
    )


def push_groups(url: str, keys, indices: list[int], seed: int = 11, nonfinite: tuple[int, ...] = ()) -> None:
    """Push groups ``g<i>`` for ``indices`` (policy version 0) onto the run's trajectory queue, as the coordinator
    does (``channels.trajectory_stream.TrajectoryStreamWriter``); those in ``nonfinite`` carry NaN rewards."""
    import asyncio

    import redis.asyncio as aioredis

    from channels.trajectory_stream import TrajectoryStreamWriter

    async def push():
        client = aioredis.Redis.from_url(url)
        queue = TrajectoryStreamWriter(client, keys)
        for index in indices:
            group = make_group(index, version=0, seed=seed)
            await queue.push(with_nonfinite_rewards(group) if index in nonfinite else group)
        await client.aclose()

    asyncio.run(push())
