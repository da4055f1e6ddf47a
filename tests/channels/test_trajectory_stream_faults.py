"""The trajectory stream under faults: lost replies, Redis outages and restarts, against real valkey servers.

A lost reply (the server ran a command, the connection broke before the answer came back) is produced by the TCP
proxy of tests/redis_faults.py in front of the real server; a push or read retried after it must not add or deliver
an entry twice. The restart tests run private servers (``private_server``) and kill them.
"""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest
import redis
import redis.asyncio as aioredis

from channels.trajectory_stream import TrajectoryStreamReader, TrajectoryStreamWriter
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
from tests.channels.trajectory_groups import KEYS, make_group, num_pending, push_groups
from tests.redis_faults import redis_proxy, reply_dropping_proxy

pytestmark = pytest.mark.integration


@contextmanager
def _reader_behind_proxy(redis_url: str, marker: bytes | None = None, trim: bool = True):
    """(the trainer's reader talking to Redis through tests/redis_faults.py's proxy, the proxy)."""
    with redis_proxy(redis_url, marker) as (proxy_url, proxy):
        client = redis.Redis.from_url(proxy_url, socket_timeout=5)
        try:
            yield TrajectoryStreamReader(client, KEYS, trim=trim), proxy
        finally:
            client.close()


# ---------------------------------------------------------------------------------------------------
# lost replies and outages (the session server behind a proxy)


def test_entries_whose_read_reply_was_lost_are_still_read_once(redis_url, client):
    groups = [make_group(i) for i in range(4)]
    ids = push_groups(redis_url, groups)
    # COUNT: only the reads of new entries carry it (not the pending-list check)
    with _reader_behind_proxy(redis_url, marker=b"COUNT") as (queue, proxy):
        # The first read's reply is lost (whatever it delivered stays pending, not in hand); the read retries.
        first = queue.read(2, timeout_s=2)
        rest = queue.read(4, timeout_s=0.5)
        queue.ack([entry_id for entry_id, _ in first + rest])
        again = queue.read(4, timeout_s=0.3)
    assert proxy.dropped == 1
    assert sorted(entry_id for entry_id, _ in first + rest) == sorted(ids)  # each entry once, none stuck pending
    assert sorted(g.group_id for _, g in first + rest) == [g.group_id for g in groups]
    assert again == [] and num_pending(client) == 0


def test_an_ack_whose_reply_was_lost_is_retried_and_leaves_nothing_pending(redis_url, client):
    push_groups(redis_url, [make_group(i) for i in range(3)])
    with _reader_behind_proxy(redis_url, marker=b"XACK", trim=False) as (queue, proxy):
        batch = queue.read(3, timeout_s=2)
        queue.ack([entry_id for entry_id, _ in batch], timeout_s=10)
    assert proxy.dropped == 1 and num_pending(client) == 0


def test_an_ack_and_trim_whose_reply_was_lost_is_retried_whole(redis_url, client):
    push_groups(redis_url, [make_group(i) for i in range(3)])
    # with trimming on, an ack is the reader's one Lua step (EVALSHA): XACK and the trim together
    with _reader_behind_proxy(redis_url, marker=b"EVALSHA", trim=True) as (queue, proxy):
        batch = queue.read(3, timeout_s=2)
        queue.ack([batch[0][0]], timeout_s=10)  # ran in Redis, its reply lost: retried, a no-op the second time
        queue.ack([entry_id for entry_id, _ in batch[1:]])
    assert proxy.dropped == 1 and num_pending(client) == 0 and client.xlen(KEYS.trajectories) == 1  # the last delivered


def test_queue_depth_is_the_last_one_read_while_redis_is_unreachable(redis_url, client):
    push_groups(redis_url, [make_group(i) for i in range(3)])
    with _reader_behind_proxy(redis_url) as (queue, proxy):
        assert queue.depth() == 3
        proxy.cut()  # in effect once it returns: the depth below is asked of an unreachable Redis
        assert queue.depth() == 3  # a report figure: the last known, no exception


def _named_group(group_id: str) -> TrajectoryGroup:
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
        queue = TrajectoryStreamWriter(client, keys, timeout_s=30)
        await queue.push(_named_group("first-group"), PromptCursor("echo", "first-group", {"seed": 0, "draws": 1}))
        cursor = PromptCursor("echo", "lost-reply-group", {"seed": 0, "draws": 2})
        lost = await queue.push(_named_group("lost-reply-group"), cursor)
        await queue.push(_named_group("third-group"), PromptCursor("echo", "third-group", {"seed": 0, "draws": 3}))
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
        queue = TrajectoryStreamWriter(client, keys)
        for name in ("a", "a"):  # no cursor, no idempotence: both land
            await queue.push(_named_group(name))
        found = await client.xlen(keys.trajectories), await queue.prompt_cursor()
        await client.aclose()
        return found

    assert asyncio.run(scenario()) == (2, None)


# ---------------------------------------------------------------------------------------------------
# Redis restarts (private servers: these kill Redis)


def test_stream_and_consumer_group_survive_a_redis_kill_and_restart(private_server):
    server = private_server()
    groups = [make_group(i) for i in range(3)]
    ids = push_groups(server.url, groups)
    before = redis.Redis.from_url(server.url)
    try:
        delivered = TrajectoryStreamReader(before, KEYS).read(1, timeout_s=2)  # delivered, not acked
    finally:
        before.close()
    server.kill()

    restarted = private_server(port=server.port)
    after = redis.Redis.from_url(restarted.url)
    try:
        assert after.xlen(KEYS.trajectories) == 3
        group_names = [g["name"] for g in after.xinfo_groups(KEYS.trajectories)]
        assert group_names == [KEYS.trainer_group.encode()]
        queue = TrajectoryStreamReader(after, KEYS)  # BUSYGROUP: the existing group is reused
        assert queue.reclaim_pending() == 1
        batch = queue.read(3, timeout_s=2)
        assert batch[:1] == delivered  # the reclaimed entry comes first
        assert [entry_id for entry_id, _ in batch] == ids
        assert [g for _, g in batch] == groups
    finally:
        after.close()


def test_push_retries_while_redis_is_down_and_succeeds_once_it_is_back(private_server):
    server = private_server()
    port = server.port

    async def scenario() -> tuple[str, str, float]:
        client = aioredis.Redis.from_url(server.url)
        try:
            queue = TrajectoryStreamWriter(client, KEYS, timeout_s=15)
            first = await queue.push(make_group(0))  # pooled connection, then Redis dies under it
            server.kill()
            restarter = threading.Timer(1.0, private_server, kwargs={"port": port})
            restarter.start()
            started = time.monotonic()
            try:
                second = await queue.push(make_group(1))
            finally:
                restarter.join()
            return first, second, time.monotonic() - started
        finally:
            await client.aclose()

    first, second, elapsed = asyncio.run(scenario())
    assert 0.9 <= elapsed < 10
    check = redis.Redis.from_url(server.url)
    try:
        batch = TrajectoryStreamReader(check, KEYS).read(2, timeout_s=2)
    finally:
        check.close()
    assert [entry_id for entry_id, _ in batch] == [first, second]
    assert [g.group_id for _, g in batch] == ["g-0", "g-1"]


def test_push_gives_up_with_timeout_error_when_redis_stays_down(private_server):
    server = private_server()
    server.kill()

    async def scenario() -> None:
        client = aioredis.Redis.from_url(server.url)
        try:
            await TrajectoryStreamWriter(client, KEYS, timeout_s=0.5).push(make_group(3))
        finally:
            await client.aclose()

    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"pushing group g-3 .*Redis unreachable for 0.5s"):
        asyncio.run(scenario())
    assert time.monotonic() - started < 3
