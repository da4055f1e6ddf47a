"""The metrics streams against the real embedded Redis: reports and end-of-run markers written by the sync and the
asyncio writers, read back by every reader, and the outage rules (periodic reports skipped, step reports retried)."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest
import redis
import redis.asyncio as aioredis

from channels.metrics_stream import (
    AsyncMetricsStreamReader,
    AsyncMetricsStreamWriter,
    MetricsStreamReader,
    MetricsStreamWriter,
)
from protos.records import MetricsReport, RoleDone
from protos.redis_keys import RedisKeys
from tests.redis_faults import redis_proxy, reply_dropping_proxy

pytestmark = pytest.mark.integration

KEYS = RedisKeys("metrics-stream")


def _report(role: str, step: int, source: str = "") -> MetricsReport:
    return MetricsReport(role, step, step + 1, 1000.0 + step, {"loss": 1.0 / (step + 1)}, source)


def _dead_url() -> str:
    with socket.socket() as probe:  # a port with no server behind it
        probe.bind(("127.0.0.1", 0))
        return f"redis://127.0.0.1:{probe.getsockname()[1]}/0"


def test_reports_and_the_end_marker_are_read_back_in_order_by_every_reader(client, redis_url):
    writer = MetricsStreamWriter(client, KEYS)
    for step in range(3):
        assert writer.post(_report("trainer", step))
    assert writer.post_done(RoleDone("trainer", 3, 4, 1003.0))
    client.xadd(KEYS.metrics("trainer"), {"m": b"not msgpack"})  # skipped with a warning by every reader

    entries = MetricsStreamReader(client, KEYS).after("trainer", "0")
    assert [e.report.step for e in entries if e.report] == [0, 1, 2]
    assert [e.done for e in entries if e.done] == [RoleDone("trainer", 3, 4, 1003.0)]
    assert MetricsStreamReader(client, KEYS).after("trainer", entries[1].entry_id)[0].report.step == 2

    async def read_async():
        async_client = aioredis.Redis.from_url(redis_url)
        reader = AsyncMetricsStreamReader(async_client, KEYS)
        first, cursor = await reader.page("trainer", "0", count=2)
        rest, end = await reader.page("trainer", cursor, count=10)
        empty, same = await reader.page("trainer", end, count=10)
        newest = await reader.newest("trainer", 3)
        await async_client.aclose()
        return first, rest, (empty, same == end), newest

    first, rest, (empty, unmoved), newest = asyncio.run(read_async())
    assert [e.report.step for e in first] == [0, 1]
    assert [e.report.step for e in rest if e.report] == [2] and rest[-1].done is not None
    assert empty == [] and unmoved
    assert [e.entry_id for e in newest] == [e.entry_id for e in entries[-2:]]  # the bad entry is the newest of 3


def test_follow_reads_several_roles_and_moves_each_cursor(client, redis_url):
    async def write():
        async_client = aioredis.Redis.from_url(redis_url)
        writer = AsyncMetricsStreamWriter(async_client, KEYS)
        assert await writer.post(_report("coordinator", 0))
        assert await writer.post(_report("rollout", 5, source="rollout-1"))
        await async_client.aclose()

    MetricsStreamWriter(client, KEYS).post(_report("trainer", 0))
    asyncio.run(write())
    reader = MetricsStreamReader(client, KEYS)
    cursors = {"trainer": "0", "coordinator": "0"}
    entries = reader.follow(cursors, block_s=1.0)
    assert sorted((e.role, e.report.step) for e in entries) == [("coordinator", 0), ("trainer", 0)]
    assert cursors["trainer"] != "0" and cursors["coordinator"] != "0"
    assert reader.follow(cursors, block_s=0.1) == []  # nothing new: waited, returned empty
    (rollout,) = reader.after("rollout", "0")
    assert rollout.report.source == "rollout-1" and rollout.report.policy_version == 6


def test_a_periodic_report_is_skipped_while_redis_is_unreachable(caplog):
    async def post():
        dead = aioredis.Redis.from_url(_dead_url(), socket_connect_timeout=1)
        posted = await AsyncMetricsStreamWriter(dead, KEYS).post(_report("coordinator", 7))
        await dead.aclose()
        return posted

    with caplog.at_level(logging.WARNING, logger="channels.metrics_stream"):
        assert asyncio.run(post()) is False
    assert "coordinator metrics report of step 7 skipped, Redis unreachable" in caplog.text


def test_reports_go_through_again_once_an_outage_ends(redis_url, client):
    async def scenario(proxy_url: str, proxy) -> list[bool]:
        through_proxy = aioredis.Redis.from_url(proxy_url, socket_timeout=2, socket_connect_timeout=2)
        writer = AsyncMetricsStreamWriter(through_proxy, KEYS)
        outcomes = [await writer.post(_report("rollout", 0, "r0"))]
        proxy.cut()  # returns once in effect on the proxy's loop
        outcomes.append(await writer.post(_report("rollout", 1, "r0")))  # periodic: skipped, not waited for
        proxy.restore()
        outcomes.append(await writer.post(_report("rollout", 2, "r0")))
        await through_proxy.aclose()
        return outcomes

    with redis_proxy(redis_url) as (proxy_url, proxy):
        outcomes = asyncio.run(scenario(proxy_url, proxy))
    assert outcomes == [True, False, True]
    steps = [e.report.step for e in MetricsStreamReader(client, KEYS).after("rollout", "0")]
    assert steps == [0, 2]


def test_a_step_report_whose_reply_was_lost_is_sent_again(redis_url, client):
    with reply_dropping_proxy(redis_url, marker=b"metrics:trainer") as (proxy_url, proxy):
        through_proxy = redis.Redis.from_url(proxy_url, socket_timeout=5)
        assert MetricsStreamWriter(through_proxy, KEYS).post(_report("trainer", 3), timeout_s=10)
        through_proxy.close()
    steps = {e.report.step for e in MetricsStreamReader(client, KEYS).after("trainer", "0")}
    assert proxy.dropped == 1 and steps == {3}  # at least once (the lost one landed too)


def test_the_end_marker_is_dropped_with_an_error_after_its_timeout(caplog):
    dead = redis.Redis.from_url(_dead_url(), socket_connect_timeout=1)
    with caplog.at_level(logging.ERROR, logger="channels.metrics_stream"):
        assert MetricsStreamWriter(dead, KEYS).post_done(RoleDone("trainer", 1, 1, 0.0), timeout_s=0.5) is False
    assert "end-of-run marker of the trainer dropped, Redis unreachable for 0.5s" in caplog.text
