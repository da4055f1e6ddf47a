"""The coordinator's pushes onto the trajectory stream, against the real embedded Redis.

A push whose reply is lost (the server ran it, the connection broke before the answer came back) is
retried by the Redis client on its own; the retry must not add a second entry. A TCP proxy in front of
the real server (tests/redis_faults.py) breaks the connection exactly there.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import redis.asyncio as aioredis

from coordinator.queue_writer import RolloutQueue
from protos.records import (
    Array,
    FinishReason,
    PromptCursor,
    Sample,
    TrajectoryGroup,
    VersionSpan,
    decode_cursor,
    decode_group,
)
from protos.redis_keys import RedisKeys
from tests.redis_faults import reply_dropping_proxy

pytestmark = pytest.mark.integration


def group(group_id: str) -> TrajectoryGroup:
    sample = Sample(
        Array.from_numpy(np.arange(3, dtype=np.int32)),
        Array.from_numpy(np.zeros(3, np.float32)),
        [VersionSpan(0, 0, 3)],
        FinishReason.STOP,
        1.0,
    )
    return TrajectoryGroup(group_id, "p", Array.from_numpy(np.array([1, 2], np.int32)), [sample], "unit", 0, 0, 0.0)


def test_a_push_whose_reply_was_lost_is_not_added_twice(redis_url):
    keys = RedisKeys("lost-reply")

    async def scenario(proxy_url: str):
        client = aioredis.Redis.from_url(proxy_url, socket_timeout=5)
        queue = RolloutQueue(client, keys, timeout_s=30)
        await queue.push(group("first-group"), PromptCursor("echo", "first-group", {"seed": 0, "draws": 1}))
        cursor = PromptCursor("echo", "lost-reply-group", {"seed": 0, "draws": 2})
        lost = await queue.push(group("lost-reply-group"), cursor)
        await queue.push(group("third-group"), PromptCursor("echo", "third-group", {"seed": 0, "draws": 3}))
        direct = aioredis.Redis.from_url(redis_url)
        entries = await direct.xrange(keys.trajectories)
        last_cursor = decode_cursor(await direct.get(keys.prompt_cursor))
        await direct.aclose()
        await client.aclose()
        return lost, [decode_group(fields[b"g"]).group_id for _, fields in entries], last_cursor

    with reply_dropping_proxy(redis_url, marker=b"lost-reply-group") as (proxy_url, proxy):
        lost, group_ids, last_cursor = asyncio.run(scenario(proxy_url))
    assert proxy.dropped == 1 and lost == ""  # its reply was lost; the client's retry found it had landed
    assert group_ids == ["first-group", "lost-reply-group", "third-group"]
    assert last_cursor.group_id == "third-group" and last_cursor.position["draws"] == 3


def test_a_push_without_a_cursor_is_a_plain_append(redis_url):
    keys = RedisKeys("plain-push")

    async def scenario():
        client = aioredis.Redis.from_url(redis_url)
        queue = RolloutQueue(client, keys)
        for name in ("a", "a"):  # no cursor, no idempotence: both land
            await queue.push(group(name))
        found = await client.xlen(keys.trajectories), await queue.prompt_cursor()
        await client.aclose()
        return found

    assert asyncio.run(scenario()) == (2, None)
