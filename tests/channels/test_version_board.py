"""The version board against the real embedded Redis: the version pointer and offset, manifests and their expiry,
announcements, IPC records, the fleet's version reports and the waits for them."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
import redis.asyncio as aioredis
import torch

from channels.version_board import MANIFEST_TTL_S, AsyncVersionBoard, VersionBoard
from protos.records import (
    CudaIpcBucket,
    CudaIpcVersion,
    ReportStatus,
    VersionReport,
    WeightManifest,
    decode_ipc_version,
)
from protos.redis_keys import RedisKeys
from tests.redis_faults import reply_dropping_proxy
from tests.waiting import wait_until_async
from weight_bus.packing import pack

pytestmark = pytest.mark.integration


def _manifest(version: int) -> WeightManifest:
    return WeightManifest(version, [], [], "127.0.0.1:1", "tcp", 0.0)


def _stream_id(entry_id: str) -> tuple[int, int]:
    millis, _, seq = entry_id.partition("-")
    return int(millis), int(seq)


def _report(server_id: str, address: str, version: int, status=ReportStatus.OK, message: str = "") -> VersionReport:
    return VersionReport(server_id, address, version, status, message, time.time())


def _run(scenario, redis_url: str, keys: RedisKeys):
    """``await scenario(AsyncVersionBoard)`` on a client of its own."""

    async def main():
        client = aioredis.Redis.from_url(redis_url)
        try:
            return await scenario(AsyncVersionBoard(client, keys))
        finally:
            await client.aclose()

    return asyncio.run(main())


def test_publish_manifest_sets_version_stores_manifest_and_announces_and_only_the_latest_never_expires(
    redis_url, client
):
    keys = RedisKeys("rdv")
    manifest, _ = pack([("w", torch.ones(4))], 3, 512, publisher_address="127.0.0.1:4242")
    sync_board = VersionBoard(client, keys)

    async def scenario(board: AsyncVersionBoard):
        assert await board.latest_version() == 0 and await board.published_version() is None
        assert await board.manifest(3) is None
        assert await board.wait_for_announcement("0-0", timeout_s=0.1) == ("0-0", None)

        await asyncio.to_thread(sync_board.publish_manifest, manifest)
        assert await board.latest_version() == 3 == await board.published_version()
        assert await board.manifest(3) == manifest == sync_board.manifest(3)
        last_id, announced = await board.wait_for_announcement("0-0", timeout_s=1)
        assert announced == 3 and last_id == await board.last_announcement_id()

        # nothing new after last_id: times out with the id unchanged
        started = time.monotonic()
        assert await board.wait_for_announcement(last_id, timeout_s=0.2) == (last_id, None)
        assert time.monotonic() - started < 1.5

        # a waiter blocked on "$" wakes up for a later publish
        manifest4 = WeightManifest(4, manifest.tensors, manifest.bucket_nbytes, "127.0.0.1:4242", "tcp", 1.0)
        waiter = asyncio.create_task(board.wait_for_announcement("$", timeout_s=5))
        await wait_until_async(
            lambda: any(c["cmd"] == "xread" and "b" in c["flags"] for c in client.client_list()),
            "the waiter blocked in XREAD",
            5,
            poll_s=0.01,
        )
        await asyncio.to_thread(sync_board.publish_manifest, manifest4)
        newest_id, newest = await asyncio.wait_for(waiter, timeout=5)
        assert newest == 4 and _stream_id(newest_id) > _stream_id(last_id)
        assert await board.latest_version() == 4 == sync_board.latest_version()
        assert await board.manifest(3) == manifest  # older one still stored

    _run(scenario, redis_url, keys)
    assert 0 < client.ttl(keys.manifest(3)) <= MANIFEST_TTL_S  # superseded: expires
    assert client.ttl(keys.manifest(4)) == -1  # the latest never does, however long the next step takes


def test_a_publish_whose_reply_was_lost_is_retried_to_the_same_state(redis_url, client):
    keys = RedisKeys("rdv-lost")
    with reply_dropping_proxy(redis_url, marker=b"EXEC") as (proxy_url, proxy):
        through_proxy = redis.Redis.from_url(proxy_url, socket_timeout=5)
        for version in (1, 2):
            VersionBoard(through_proxy, keys).publish_manifest(_manifest(version), timeout_s=10)
        through_proxy.close()
    assert proxy.dropped == 1  # the first publish ran, its reply was lost, and it was run again
    assert int(client.get(keys.policy_version)) == 2 and client.ttl(keys.manifest(2)) == -1
    assert 0 < client.ttl(keys.manifest(1)) <= MANIFEST_TTL_S


def test_wait_for_announcement_returns_the_newest_of_several(redis_url, client):
    keys = RedisKeys("rdv2")
    for version in (1, 2, 3):
        VersionBoard(client, keys).publish_manifest(_manifest(version))

    async def scenario(board: AsyncVersionBoard):
        return await board.wait_for_announcement("0-0", timeout_s=1)

    _, newest = _run(scenario, redis_url, keys)
    assert newest == 3


def test_a_wait_shorter_than_a_millisecond_returns_instead_of_blocking_forever(redis_url):
    async def scenario(board: AsyncVersionBoard):
        return await asyncio.wait_for(board.wait_for_announcement("$", timeout_s=0.0001), timeout=5)

    assert _run(scenario, redis_url, RedisKeys("rdv-short")) == ("$", None)


def test_the_version_pointer_is_set_once_and_read_with_the_offset(redis_url, client):
    keys = RedisKeys("offset")
    board = VersionBoard(client, keys)

    async def read(async_board: AsyncVersionBoard):
        return await async_board.version_and_offset()

    assert _run(read, redis_url, keys) == (0, 0)  # a fresh run
    assert board.init_version(5) and not board.init_version(9)  # the first trainer's version stays
    board.set_version_offset(2)
    board.set_version_offset(2)  # repeating it changes nothing
    assert _run(read, redis_url, keys) == (5, 2)
    board.set_version_offset(-1)  # a non-finite step lowers it
    assert _run(read, redis_url, keys) == (5, -1) and board.latest_version() == 5


def test_ipc_records_are_stored_expiring_and_dropped(redis_url, client):
    keys = RedisKeys("ipc")
    board = VersionBoard(client, keys)
    bucket = CudaIpcBucket(64, 0, b"handle", 64, 0, b"counter", 0, b"event", False)
    record = CudaIpcVersion(3, "GPU-0", 1234, [bucket])

    async def read(async_board: AsyncVersionBoard):
        return await async_board.ipc_record(3)

    assert _run(read, redis_url, keys) is None
    board.store_ipc_record(record)
    assert decode_ipc_version(_run(read, redis_url, keys)) == record
    assert 0 < client.ttl(keys.ipc_buckets(3)) <= MANIFEST_TTL_S
    board.drop_ipc_record(3)
    board.drop_ipc_record(3, timeout_s=0)  # a DEL: dropping twice is fine
    assert _run(read, redis_url, keys) is None


def test_report_version_and_fleet_reports_round_trip(redis_url, client):
    keys = RedisKeys("fleet")
    client.hset(keys.fleet, "broken", b"not a report")  # skipped with a warning, not fatal

    async def scenario(board: AsyncVersionBoard):
        await board.report_version(_report("rollout-0", "127.0.0.1:7000", 1))
        await board.report_version(_report("rollout-1", "127.0.0.1:7001", 1))
        await board.report_version(_report("rollout-0", "127.0.0.1:7000", 1, ReportStatus.STALE, "fetch timed out"))
        await board.report_version(_report("rollout-1", "127.0.0.1:7001", 2))
        return await board.fleet_reports()

    reports = _run(scenario, redis_url, keys)
    assert VersionBoard(client, keys).fleet_reports() == reports  # the sync reader sees the same
    assert sorted(reports) == ["rollout-0", "rollout-1"]
    zero, one = reports["rollout-0"], reports["rollout-1"]
    assert (zero.server_id, zero.address, zero.policy_version) == ("rollout-0", "127.0.0.1:7000", 1)
    assert zero.status is ReportStatus.STALE and zero.message == "fetch timed out"
    assert (one.policy_version, one.status, one.message) == (2, ReportStatus.OK, "")
    assert abs(one.time_s - time.time()) < 60


def test_wait_for_change_returns_on_a_changed_report_or_an_announcement_made_after_the_ids_not_on_a_heartbeat(
    redis_url, client
):
    keys = RedisKeys("changes")
    board = VersionBoard(client, keys)
    board.publish_manifest(_manifest(1))  # an announcement before the ids: not a change

    async def scenario(async_board: AsyncVersionBoard):
        ids = await async_board.last_change_ids()
        quiet = await async_board.wait_for_change(ids, timeout_s=0.05)  # nothing since: the same ids back
        await async_board.report_version(_report("rollout-0", "127.0.0.1:7000", 1), changed=False)  # a heartbeat
        after_beat = await async_board.wait_for_change(ids, timeout_s=0.05)
        assert after_beat == ids and "rollout-0" in await async_board.fleet_reports()  # registered, nobody woken
        await async_board.report_version(_report("rollout-0", "127.0.0.1:7000", 1))
        after_report = await async_board.wait_for_change(ids, timeout_s=30)
        await asyncio.to_thread(board.publish_manifest, _manifest(2))
        after_publish = await async_board.wait_for_change(after_report, timeout_s=30)
        return ids, quiet, after_report, after_publish

    ids, quiet, after_report, after_publish = _run(scenario, redis_url, keys)
    announce, changes = keys.weight_announcements, keys.fleet_changes
    assert ids[changes] == "0-0" and ids[announce] != "0-0" and quiet == ids
    assert after_report[announce] == ids[announce] and after_report[changes] != "0-0"
    assert after_publish[changes] == after_report[changes] and after_publish[announce] != ids[announce]
    ((_entry_id, fields),) = client.xrange(changes)
    assert fields == {b"s": b"rollout-0"}
