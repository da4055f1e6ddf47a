"""Helpers of the trajectory-stream tests: small valid groups, and pushing them as the coordinator does."""

from __future__ import annotations

import asyncio

import numpy as np
import redis
import redis.asyncio as aioredis

from channels.trajectory_stream import TrajectoryStreamWriter
from protos.records import Array, FinishReason, Sample, TrajectoryGroup, VersionSpan
from protos.redis_keys import RedisKeys

KEYS = RedisKeys("queue-test")


def make_group(i: int) -> TrajectoryGroup:
    """Group ``g-<i>``: two samples of three tokens, rewards 0 and 1."""
    samples = [
        Sample(
            response_token_ids=Array.from_numpy(np.array([i, j, 7], dtype=np.int32)),
            rollout_logprobs=Array.from_numpy(np.array([-0.5, -0.25 * j, -1.0], dtype=np.float32)),
            version_spans=[VersionSpan(i, 0, 3)],
            finish_reason=FinishReason.STOP,
            reward=float(j % 2),
            server_id=f"rollout-{j}",
        )
        for j in range(2)
    ]
    return TrajectoryGroup(
        group_id=f"g-{i}",
        prompt_id=f"p-{i}",
        prompt_token_ids=Array.from_numpy(np.array([1, 2, i], np.int32)),
        samples=samples,
        data_source="echo",
        admission_index=i,
        admitted_at_version=i,
        created_s=100.0 + i,
    )


def push_groups(url: str, groups: list[TrajectoryGroup], timeout_s: float = 5.0) -> list[str]:
    """Push ``groups`` onto ``KEYS.trajectories`` through a writer of its own; returns their entry ids."""

    async def push_all() -> list[str]:
        client = aioredis.Redis.from_url(url)
        try:
            writer = TrajectoryStreamWriter(client, KEYS, timeout_s=timeout_s)
            return [await writer.push(group) for group in groups]
        finally:
            await client.aclose()

    return asyncio.run(push_all())


def num_pending(client: redis.Redis) -> int:
    """Entries delivered to the trainers' group and not yet acknowledged."""
    return client.xpending(KEYS.trajectories, KEYS.trainer_group)["pending"]
