"""The trajectory stream end to end: TrajectoryStreamWriter (XADD) -> TrajectoryStreamReader (consumer group).

Reading, acknowledging, trimming, crash recovery (pending entries reclaimed) and bad payloads, against the session's
real valkey server (flushed per test). Outages and lost replies: test_trajectory_stream_faults.py.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis
import redis.asyncio as aioredis

from channels.trajectory_stream import TrajectoryStreamReader, TrajectoryStreamWriter
from tests.channels.trajectory_groups import KEYS, make_group, num_pending, push_groups

pytestmark = pytest.mark.integration

# ---------------------------------------------------------------------------------------------------
# reading


def test_pushed_groups_are_read_back_equal_and_in_order(redis_url, client):
    queue = TrajectoryStreamReader(client, KEYS)
    groups = [make_group(i) for i in range(3)]
    ids = push_groups(redis_url, groups)
    batch = queue.read(3, timeout_s=2)
    assert [entry_id for entry_id, _ in batch] == ids
    assert [group for _, group in batch] == groups


def test_groups_pushed_before_the_trainer_starts_are_not_lost(redis_url, client):
    ids = push_groups(redis_url, [make_group(0), make_group(1)])
    queue = TrajectoryStreamReader(client, KEYS)  # consumer group created from id 0 after the pushes
    assert [entry_id for entry_id, _ in queue.read(2, timeout_s=2)] == ids


def test_read_returns_at_most_num_groups(redis_url, client):
    queue = TrajectoryStreamReader(client, KEYS)
    groups = [make_group(i) for i in range(5)]
    push_groups(redis_url, groups)
    first = queue.read(2, timeout_s=2)
    assert [g for _, g in first] == groups[:2]
    rest = queue.read(10, timeout_s=0.3)
    assert [g for _, g in rest] == groups[2:]


def test_read_returns_fewer_groups_once_the_timeout_passes(redis_url, client):
    queue = TrajectoryStreamReader(client, KEYS)
    push_groups(redis_url, [make_group(0)])
    started = time.monotonic()
    batch = queue.read(4, timeout_s=0.3)
    elapsed = time.monotonic() - started
    assert [g.group_id for _, g in batch] == ["g-0"]
    assert 0.2 <= elapsed < 1.5
    started = time.monotonic()
    assert queue.read(1, timeout_s=0.2) == []
    assert time.monotonic() - started < 1.5


def test_read_waits_for_a_group_pushed_during_the_wait(redis_url, client):
    queue = TrajectoryStreamReader(client, KEYS)
    pusher = threading.Timer(0.3, push_groups, args=(redis_url, [make_group(9)]))
    pusher.start()
    try:
        batch = queue.read(1, timeout_s=5)
    finally:
        pusher.join()
    assert [g.group_id for _, g in batch] == ["g-9"]


def test_ack_removes_entries_from_the_pending_list(redis_url, client):
    queue = TrajectoryStreamReader(client, KEYS)
    push_groups(redis_url, [make_group(i) for i in range(3)])
    batch = queue.read(3, timeout_s=2)
    assert num_pending(client) == 3
    queue.ack([batch[0][0]])
    assert num_pending(client) == 2
    queue.ack([entry_id for entry_id, _ in batch[1:]])
    assert num_pending(client) == 0
    queue.ack([])  # no-op


def test_one_ack_of_thousands_of_entries_acknowledges_and_trims_them_in_one_round_trip(redis_url, client):
    queue = TrajectoryStreamReader(client, KEYS)
    pipe = client.pipeline(transaction=False)
    for index in range(2500):  # more ids than one Lua unpack takes: the step acknowledges them in chunks
        pipe.xadd(KEYS.trajectories, {"g": b"x"}, id=f"{index + 1}-0")
    pipe.execute()
    entries = client.xreadgroup(KEYS.trainer_group, queue.consumer, {KEYS.trajectories: ">"}, count=3000)[0][1]
    assert queue.trim_acknowledged() == 0  # all pending: nothing to trim (and the step is loaded in Redis now)
    client.config_resetstat()
    queue.ack([entry_id.decode() for entry_id, _ in entries])
    calls = {name: stats["calls"] for name, stats in client.info("commandstats").items()}
    assert calls.get("cmdstat_evalsha") == 1 and "cmdstat_xinfo|groups" in calls  # the trim ran inside the step
    assert num_pending(client) == 0 and client.xlen(KEYS.trajectories) == 1  # the last delivered entry stays


def test_acknowledged_entries_are_trimmed_but_pending_and_undelivered_ones_stay(redis_url, client):
    queue = TrajectoryStreamReader(client, KEYS)
    push_groups(redis_url, [make_group(i) for i in range(6)])
    batch = queue.read(4, timeout_s=2)
    queue.ack([batch[1][0], batch[2][0]])  # entry 0 stays pending: nothing from it onwards may go
    assert client.xlen(KEYS.trajectories) == 6
    queue.ack([batch[0][0]])  # 0-2 acked, 3 pending, 4-5 undelivered
    assert client.xlen(KEYS.trajectories) == 3 and queue.depth() == 2
    queue.ack([batch[3][0]])
    rest = queue.read(2, timeout_s=2)
    assert [g.group_id for _, g in rest] == ["g-4", "g-5"]  # undelivered entries were never trimmed
    queue.ack([entry_id for entry_id, _ in rest])
    assert client.xlen(KEYS.trajectories) <= 1 and num_pending(client) == 0 and queue.depth() == 0


# ---------------------------------------------------------------------------------------------------
# crash recovery and bad payloads


def test_unacked_entries_are_reclaimed_by_a_restarted_trainer(redis_url, client):
    crashed = TrajectoryStreamReader(client, KEYS, consumer="trainer-0")
    groups = [make_group(i) for i in range(3)]
    push_groups(redis_url, groups)
    delivered = crashed.read(2, timeout_s=2)  # never acked: the trainer "crashes" here
    assert num_pending(client) == 2

    fresh_client = redis.Redis.from_url(redis_url)
    try:
        restarted = TrajectoryStreamReader(fresh_client, KEYS, consumer="trainer-0")
        assert restarted.reclaim_pending() == 2
        again = restarted.read(3, timeout_s=1)
        assert again[:2] == delivered  # the same entries, first
        assert [g for _, g in again] == groups  # then the undelivered one
        restarted.ack([entry_id for entry_id, _ in again])
        assert num_pending(fresh_client) == 0
    finally:
        fresh_client.close()


def test_a_trainer_with_another_consumer_name_takes_over_pending_entries(redis_url, client):
    crashed = TrajectoryStreamReader(client, KEYS, consumer="trainer-0")
    push_groups(redis_url, [make_group(0)])
    delivered = crashed.read(1, timeout_s=2)
    successor = TrajectoryStreamReader(client, KEYS, consumer="trainer-1")
    assert successor.reclaim_pending() == 1
    assert successor.read(1, timeout_s=0.1) == delivered
    consumers = {c["name"]: c["pending"] for c in client.xinfo_consumers(KEYS.trajectories, KEYS.trainer_group)}
    assert consumers[b"trainer-1"] == 1 and consumers.get(b"trainer-0", 0) == 0


def test_reclaim_with_nothing_pending_returns_zero(client):
    assert TrajectoryStreamReader(client, KEYS).reclaim_pending() == 0


def test_undecodable_payload_is_dead_lettered_acked_and_skipped(redis_url, client):
    queue = TrajectoryStreamReader(client, KEYS)
    client.xadd(KEYS.trajectories, {"g": b"junk"})
    client.xadd(KEYS.trajectories, {"other": b"no g field"})
    (valid_id,) = push_groups(redis_url, [make_group(5)])
    batch = queue.read(1, timeout_s=2)
    assert batch == [(valid_id, make_group(5))]
    assert client.lrange(KEYS.dead_letters, 0, -1) == [b"junk", b""]
    assert queue.num_dead_letters == 2
    assert num_pending(client) == 1  # only the valid group awaits its ack


def test_reclaim_dead_letters_a_pending_entry_without_payload_field(client):
    TrajectoryStreamReader(client, KEYS)
    client.xadd(KEYS.trajectories, {"other": b"1"})
    client.xreadgroup(KEYS.trainer_group, "trainer-0", {KEYS.trajectories: ">"})  # delivered, never acked
    queue = TrajectoryStreamReader(client, KEYS)
    queue.reclaim_pending()
    assert queue.read(1, timeout_s=0.1) == []
    assert queue.num_dead_letters == 1


def test_reclaim_pending_twice_does_not_duplicate_entries(redis_url, client):
    TrajectoryStreamReader(client, KEYS)  # creates the consumer group
    push_groups(redis_url, [make_group(0)])
    client.xreadgroup(KEYS.trainer_group, "trainer-0", {KEYS.trajectories: ">"})
    queue = TrajectoryStreamReader(client, KEYS)
    queue.reclaim_pending()
    assert queue.reclaim_pending() == 1
    assert len(queue.read(5, timeout_s=0.1)) == 1


def test_depth_counts_undelivered_entries(redis_url, client):
    queue = TrajectoryStreamReader(client, KEYS)
    assert queue.depth() == 0
    push_groups(redis_url, [make_group(i) for i in range(3)])
    assert queue.depth() == 3
    batch = queue.read(2, timeout_s=2)
    assert queue.depth() == 1
    queue.ack([entry_id for entry_id, _ in batch])
    assert queue.depth() == 1  # acking changes pending, not the backlog
    queue.read(1, timeout_s=2)
    assert queue.depth() == 0


def test_the_writers_depth_matches_the_readers(redis_url, client):
    async def depth() -> int:
        c = aioredis.Redis.from_url(redis_url)
        try:
            return await TrajectoryStreamWriter(c, KEYS).depth()
        finally:
            await c.aclose()

    assert asyncio.run(depth()) == 0  # no stream yet
    push_groups(redis_url, [make_group(0), make_group(1)])
    assert asyncio.run(depth()) == 2  # stream without a consumer group: its length
    queue = TrajectoryStreamReader(client, KEYS)
    queue.read(1, timeout_s=2)
    assert asyncio.run(depth()) == queue.depth() == 1
