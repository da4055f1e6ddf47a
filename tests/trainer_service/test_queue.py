"""The trajectory stream end to end: coordinator RolloutQueue (XADD) -> trainer TrajectoryQueue (consumer group).

Every test talks to a real valkey server: the shared session server (flushed per test), or a private
one for the tests that kill and restart Redis.
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

from coordinator.queue_writer import RolloutQueue
from coordinator.redis_server import EmbeddedRedis
from protos.records import Array, FinishReason, Sample, TrajectoryGroup, VersionSpan
from protos.redis_keys import RedisKeys
from tests.redis_faults import redis_proxy
from trainer_service.queue import TrajectoryQueue

pytestmark = pytest.mark.integration

KEYS = RedisKeys("queue-test")


def _group(i: int) -> TrajectoryGroup:
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


def _push(url: str, groups: list[TrajectoryGroup], timeout_s: float = 5.0) -> list[str]:
    async def push_all() -> list[str]:
        client = aioredis.Redis.from_url(url)
        try:
            queue = RolloutQueue(client, KEYS, timeout_s=timeout_s)
            return [await queue.push(group) for group in groups]
        finally:
            await client.aclose()

    return asyncio.run(push_all())


@pytest.fixture
def client(redis_url):
    c = redis.Redis.from_url(redis_url)
    try:
        yield c
    finally:
        c.close()


@contextmanager
def _queue_behind_proxy(redis_url: str, marker: bytes | None = None, trim: bool = True):
    """(the trainer's queue talking to Redis through tests/redis_faults.py's proxy, the proxy)."""
    with redis_proxy(redis_url, marker) as (proxy_url, proxy):
        client = redis.Redis.from_url(proxy_url, socket_timeout=5)
        try:
            yield TrajectoryQueue(client, KEYS, trim=trim), proxy
        finally:
            client.close()


def _pending(client: redis.Redis) -> int:
    return client.xpending(KEYS.trajectories, KEYS.trainer_group)["pending"]


# ---------------------------------------------------------------------------------------------------
# reading


def test_pushed_groups_are_read_back_equal_and_in_order(redis_url, client):
    queue = TrajectoryQueue(client, KEYS)
    groups = [_group(i) for i in range(3)]
    ids = _push(redis_url, groups)
    batch = queue.read(3, timeout_s=2)
    assert [entry_id for entry_id, _ in batch] == ids
    assert [group for _, group in batch] == groups


def test_groups_pushed_before_the_trainer_starts_are_not_lost(redis_url, client):
    ids = _push(redis_url, [_group(0), _group(1)])
    queue = TrajectoryQueue(client, KEYS)  # consumer group created from id 0 after the pushes
    assert [entry_id for entry_id, _ in queue.read(2, timeout_s=2)] == ids


def test_read_returns_at_most_num_groups(redis_url, client):
    queue = TrajectoryQueue(client, KEYS)
    groups = [_group(i) for i in range(5)]
    _push(redis_url, groups)
    first = queue.read(2, timeout_s=2)
    assert [g for _, g in first] == groups[:2]
    rest = queue.read(10, timeout_s=0.3)
    assert [g for _, g in rest] == groups[2:]


def test_read_returns_fewer_groups_once_the_timeout_passes(redis_url, client):
    queue = TrajectoryQueue(client, KEYS)
    _push(redis_url, [_group(0)])
    started = time.monotonic()
    batch = queue.read(4, timeout_s=0.3)
    elapsed = time.monotonic() - started
    assert [g.group_id for _, g in batch] == ["g-0"]
    assert 0.2 <= elapsed < 1.5
    started = time.monotonic()
    assert queue.read(1, timeout_s=0.2) == []
    assert time.monotonic() - started < 1.5


def test_read_waits_for_a_group_pushed_during_the_wait(redis_url, client):
    queue = TrajectoryQueue(client, KEYS)
    pusher = threading.Timer(0.3, _push, args=(redis_url, [_group(9)]))
    pusher.start()
    try:
        batch = queue.read(1, timeout_s=5)
    finally:
        pusher.join()
    assert [g.group_id for _, g in batch] == ["g-9"]


def test_entries_whose_read_reply_was_lost_are_still_read_once(redis_url, client):
    groups = [_group(i) for i in range(4)]
    ids = _push(redis_url, groups)
    # COUNT: only the reads of new entries carry it (not the pending-list check)
    with _queue_behind_proxy(redis_url, marker=b"COUNT") as (queue, proxy):
        # The first read's reply is lost (whatever it delivered stays pending, not in hand); the read retries.
        first = queue.read(2, timeout_s=2)
        rest = queue.read(4, timeout_s=0.5)
        queue.ack([entry_id for entry_id, _ in first + rest])
        again = queue.read(4, timeout_s=0.3)
    assert proxy.dropped == 1
    assert sorted(entry_id for entry_id, _ in first + rest) == sorted(ids)  # each entry once, none stuck pending
    assert sorted(g.group_id for _, g in first + rest) == [g.group_id for g in groups]
    assert again == [] and _pending(client) == 0


def test_an_ack_whose_reply_was_lost_is_retried_and_leaves_nothing_pending(redis_url, client):
    _push(redis_url, [_group(i) for i in range(3)])
    with _queue_behind_proxy(redis_url, marker=b"XACK", trim=False) as (queue, proxy):
        batch = queue.read(3, timeout_s=2)
        queue.ack([entry_id for entry_id, _ in batch], timeout_s=10)
    assert proxy.dropped == 1 and _pending(client) == 0


def test_a_trim_that_fails_after_the_ack_is_left_to_the_next_ack(redis_url, client):
    _push(redis_url, [_group(i) for i in range(3)])
    with _queue_behind_proxy(redis_url, marker=b"XINFO", trim=True) as (queue, proxy):
        batch = queue.read(3, timeout_s=2)
        queue.ack([batch[0][0]])  # acknowledged; the trim after it broke
        queue.ack([entry_id for entry_id, _ in batch[1:]])  # this one trims what the first could not
    assert proxy.dropped == 1 and _pending(client) == 0 and client.xlen(KEYS.trajectories) == 1  # the last delivered


def test_queue_depth_is_the_last_one_read_while_redis_is_unreachable(redis_url, client):
    _push(redis_url, [_group(i) for i in range(3)])
    with _queue_behind_proxy(redis_url) as (queue, proxy):
        assert queue.depth() == 3
        proxy.cut()
        time.sleep(0.2)
        assert queue.depth() == 3  # a report figure: the last known, no exception


def test_ack_removes_entries_from_the_pending_list(redis_url, client):
    queue = TrajectoryQueue(client, KEYS)
    _push(redis_url, [_group(i) for i in range(3)])
    batch = queue.read(3, timeout_s=2)
    assert _pending(client) == 3
    queue.ack([batch[0][0]])
    assert _pending(client) == 2
    queue.ack([entry_id for entry_id, _ in batch[1:]])
    assert _pending(client) == 0
    queue.ack([])  # no-op


def test_acknowledged_entries_are_trimmed_but_pending_and_undelivered_ones_stay(redis_url, client):
    queue = TrajectoryQueue(client, KEYS)
    _push(redis_url, [_group(i) for i in range(6)])
    batch = queue.read(4, timeout_s=2)
    queue.ack([batch[1][0], batch[2][0]])  # entry 0 stays pending: nothing from it onwards may go
    assert client.xlen(KEYS.trajectories) == 6
    queue.ack([batch[0][0]])  # 0-2 acked, 3 pending, 4-5 undelivered
    assert client.xlen(KEYS.trajectories) == 3 and queue.depth() == 2
    queue.ack([batch[3][0]])
    rest = queue.read(2, timeout_s=2)
    assert [g.group_id for _, g in rest] == ["g-4", "g-5"]  # undelivered entries were never trimmed
    queue.ack([entry_id for entry_id, _ in rest])
    assert client.xlen(KEYS.trajectories) <= 1 and _pending(client) == 0 and queue.depth() == 0


# ---------------------------------------------------------------------------------------------------
# crash recovery and bad payloads


def test_unacked_entries_are_reclaimed_by_a_restarted_trainer(redis_url, client):
    crashed = TrajectoryQueue(client, KEYS, consumer="trainer-0")
    groups = [_group(i) for i in range(3)]
    _push(redis_url, groups)
    delivered = crashed.read(2, timeout_s=2)  # never acked: the trainer "crashes" here
    assert _pending(client) == 2

    fresh_client = redis.Redis.from_url(redis_url)
    try:
        restarted = TrajectoryQueue(fresh_client, KEYS, consumer="trainer-0")
        assert restarted.reclaim_pending() == 2
        again = restarted.read(3, timeout_s=1)
        assert again[:2] == delivered  # the same entries, first
        assert [g for _, g in again] == groups  # then the undelivered one
        restarted.ack([entry_id for entry_id, _ in again])
        assert _pending(fresh_client) == 0
    finally:
        fresh_client.close()


def test_a_trainer_with_another_consumer_name_takes_over_pending_entries(redis_url, client):
    crashed = TrajectoryQueue(client, KEYS, consumer="trainer-0")
    _push(redis_url, [_group(0)])
    delivered = crashed.read(1, timeout_s=2)
    successor = TrajectoryQueue(client, KEYS, consumer="trainer-1")
    assert successor.reclaim_pending() == 1
    assert successor.read(1, timeout_s=0.1) == delivered
    consumers = {c["name"]: c["pending"] for c in client.xinfo_consumers(KEYS.trajectories, KEYS.trainer_group)}
    assert consumers[b"trainer-1"] == 1 and consumers.get(b"trainer-0", 0) == 0


def test_reclaim_with_nothing_pending_returns_zero(client):
    assert TrajectoryQueue(client, KEYS).reclaim_pending() == 0


def test_undecodable_payload_is_dead_lettered_acked_and_skipped(redis_url, client):
    queue = TrajectoryQueue(client, KEYS)
    client.xadd(KEYS.trajectories, {"g": b"junk"})
    client.xadd(KEYS.trajectories, {"other": b"no g field"})
    (valid_id,) = _push(redis_url, [_group(5)])
    batch = queue.read(1, timeout_s=2)
    assert batch == [(valid_id, _group(5))]
    assert client.lrange(KEYS.dead_letters, 0, -1) == [b"junk", b""]
    assert queue.num_dead_letters == 2
    assert _pending(client) == 1  # only the valid group awaits its ack


def test_reclaim_dead_letters_a_pending_entry_without_payload_field(client):
    TrajectoryQueue(client, KEYS)
    client.xadd(KEYS.trajectories, {"other": b"1"})
    client.xreadgroup(KEYS.trainer_group, "trainer-0", {KEYS.trajectories: ">"})  # delivered, never acked
    queue = TrajectoryQueue(client, KEYS)
    queue.reclaim_pending()
    assert queue.read(1, timeout_s=0.1) == []
    assert queue.num_dead_letters == 1


def test_reclaim_pending_twice_does_not_duplicate_entries(redis_url, client):
    TrajectoryQueue(client, KEYS)  # creates the consumer group
    _push(redis_url, [_group(0)])
    client.xreadgroup(KEYS.trainer_group, "trainer-0", {KEYS.trajectories: ">"})
    queue = TrajectoryQueue(client, KEYS)
    queue.reclaim_pending()
    assert queue.reclaim_pending() == 1
    assert len(queue.read(5, timeout_s=0.1)) == 1


def test_depth_counts_undelivered_entries(redis_url, client):
    queue = TrajectoryQueue(client, KEYS)
    assert queue.depth() == 0
    _push(redis_url, [_group(i) for i in range(3)])
    assert queue.depth() == 3
    batch = queue.read(2, timeout_s=2)
    assert queue.depth() == 1
    queue.ack([entry_id for entry_id, _ in batch])
    assert queue.depth() == 1  # acking changes pending, not the backlog
    queue.read(1, timeout_s=2)
    assert queue.depth() == 0


def test_rollout_queue_depth_matches_the_trainer_view(redis_url, client):
    async def depth() -> int:
        c = aioredis.Redis.from_url(redis_url)
        try:
            return await RolloutQueue(c, KEYS).depth()
        finally:
            await c.aclose()

    assert asyncio.run(depth()) == 0  # no stream yet
    _push(redis_url, [_group(0), _group(1)])
    assert asyncio.run(depth()) == 2  # stream without a consumer group: its length
    queue = TrajectoryQueue(client, KEYS)
    queue.read(1, timeout_s=2)
    assert asyncio.run(depth()) == queue.depth() == 1


# ---------------------------------------------------------------------------------------------------
# Redis restarts (private servers: these kill Redis)


@pytest.fixture
def private_server(tmp_path):
    servers: list[EmbeddedRedis] = []

    def start(port: int = 0) -> EmbeddedRedis:
        server = EmbeddedRedis(port=port, data_dir=str(tmp_path / "valkey"), appendonly=True).start()
        servers.append(server)
        return server

    (tmp_path / "valkey").mkdir()
    try:
        yield start
    finally:
        for server in servers:
            server.stop()


def test_stream_and_consumer_group_survive_a_redis_kill_and_restart(private_server):
    server = private_server()
    groups = [_group(i) for i in range(3)]
    ids = _push(server.url, groups)
    before = redis.Redis.from_url(server.url)
    try:
        delivered = TrajectoryQueue(before, KEYS).read(1, timeout_s=2)  # delivered, not acked
    finally:
        before.close()
    server.kill()

    restarted = private_server(port=server.port)
    after = redis.Redis.from_url(restarted.url)
    try:
        assert after.xlen(KEYS.trajectories) == 3
        group_names = [g["name"] for g in after.xinfo_groups(KEYS.trajectories)]
        assert group_names == [KEYS.trainer_group.encode()]
        queue = TrajectoryQueue(after, KEYS)  # BUSYGROUP: the existing group is reused
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
            queue = RolloutQueue(client, KEYS, timeout_s=15)
            first = await queue.push(_group(0))  # pooled connection, then Redis dies under it
            server.kill()
            restarter = threading.Timer(1.0, private_server, kwargs={"port": port})
            restarter.start()
            started = time.monotonic()
            try:
                second = await queue.push(_group(1))
            finally:
                restarter.join()
            return first, second, time.monotonic() - started
        finally:
            await client.aclose()

    first, second, elapsed = asyncio.run(scenario())
    assert 0.9 <= elapsed < 10
    check = redis.Redis.from_url(server.url)
    try:
        batch = TrajectoryQueue(check, KEYS).read(2, timeout_s=2)
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
            await RolloutQueue(client, KEYS, timeout_s=0.5).push(_group(3))
        finally:
            await client.aclose()

    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"pushing group g-3 .*Redis unreachable for 0.5s"):
        asyncio.run(scenario())
    assert time.monotonic() - started < 3
