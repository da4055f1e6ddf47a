"""Weight bus: the Redis rendezvous (weight_bus.rendezvous) on the real embedded server."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
import redis.asyncio as aioredis

from protos.records import ReportStatus, WeightManifest
from protos.redis_keys import RedisKeys
from tests.weight_bus.bus_tensors import named_tensors
from weight_bus import rendezvous
from weight_bus.packing import pack

pytestmark = pytest.mark.integration


# ---------------------------------------------------------------------------------------------------
# Redis rendezvous


def _stream_id(entry_id: str) -> tuple[int, int]:
    millis, _, seq = entry_id.partition("-")
    return int(millis), int(seq)


def test_publish_manifest_sets_version_stores_manifest_and_announces_and_only_the_latest_never_expires(redis_url):
    keys = RedisKeys("rdv")
    manifest, _ = pack(named_tensors(), 3, 512, publisher_address="127.0.0.1:4242")
    sync_client = redis.Redis.from_url(redis_url)

    async def scenario():
        client = aioredis.Redis.from_url(redis_url)
        try:
            assert await rendezvous.latest_version(client, keys) == 0
            assert await rendezvous.get_manifest(client, keys, 3) is None
            first_id, first = await rendezvous.wait_for_announcement(client, keys, "0-0", timeout_s=0.1)
            assert (first_id, first) == ("0-0", None)

            await asyncio.to_thread(rendezvous.publish_manifest, sync_client, keys, manifest)
            assert await rendezvous.latest_version(client, keys) == 3
            assert await rendezvous.get_manifest(client, keys, 3) == manifest
            last_id, announced = await rendezvous.wait_for_announcement(client, keys, "0-0", timeout_s=1)
            assert announced == 3 and last_id != "0-0"

            # nothing new after last_id: times out with the id unchanged
            started = time.monotonic()
            assert await rendezvous.wait_for_announcement(client, keys, last_id, timeout_s=0.2) == (last_id, None)
            assert time.monotonic() - started < 1.5

            # a waiter blocked on "$" wakes up for a later publish
            manifest4 = WeightManifest(4, manifest.tensors, manifest.bucket_nbytes, "127.0.0.1:4242", "tcp", 1.0)
            waiter = asyncio.create_task(rendezvous.wait_for_announcement(client, keys, "$", timeout_s=5))
            await asyncio.sleep(0.2)
            await asyncio.to_thread(rendezvous.publish_manifest, sync_client, keys, manifest4)
            newest_id, newest = await asyncio.wait_for(waiter, timeout=5)
            assert newest == 4 and _stream_id(newest_id) > _stream_id(last_id)
            assert await rendezvous.latest_version(client, keys) == 4
            assert await rendezvous.get_manifest(client, keys, 3) == manifest  # older one still stored
        finally:
            await client.aclose()

    try:
        asyncio.run(scenario())
        assert 0 < sync_client.ttl(keys.manifest(3)) <= rendezvous.MANIFEST_TTL_S  # superseded: expires
        assert sync_client.ttl(keys.manifest(4)) == -1  # the latest never does, however long the next step takes
    finally:
        sync_client.close()


def test_a_publish_whose_reply_was_lost_is_retried_to_the_same_state(redis_url):
    from tests.redis_faults import reply_dropping_proxy

    keys = RedisKeys("rdv-lost")
    direct = redis.Redis.from_url(redis_url)
    try:
        with reply_dropping_proxy(redis_url, marker=b"EXEC") as (proxy_url, proxy):
            through_proxy = redis.Redis.from_url(proxy_url, socket_timeout=5)
            for version in (1, 2):
                rendezvous.publish_manifest(
                    through_proxy, keys, WeightManifest(version, [], [], "h:1", "tcp", 0.0), timeout_s=10
                )
            through_proxy.close()
        assert proxy.dropped == 1  # the first publish ran, its reply was lost, and it was run again
        assert int(direct.get(keys.policy_version)) == 2 and direct.ttl(keys.manifest(2)) == -1
        assert 0 < direct.ttl(keys.manifest(1)) <= rendezvous.MANIFEST_TTL_S
    finally:
        direct.close()


def test_wait_for_announcement_returns_the_newest_of_several(redis_url):
    keys = RedisKeys("rdv2")
    sync_client = redis.Redis.from_url(redis_url)
    try:
        for version in (1, 2, 3):
            manifest = WeightManifest(version, [], [], "127.0.0.1:1", "tcp", 0.0)
            rendezvous.publish_manifest(sync_client, keys, manifest)
    finally:
        sync_client.close()

    async def scenario():
        client = aioredis.Redis.from_url(redis_url)
        try:
            return await rendezvous.wait_for_announcement(client, keys, "0-0", timeout_s=1)
        finally:
            await client.aclose()

    _, newest = asyncio.run(scenario())
    assert newest == 3


def test_report_version_and_fleet_reports_round_trip(redis_url):
    keys = RedisKeys("fleet")

    async def scenario():
        client = aioredis.Redis.from_url(redis_url)
        try:
            assert await rendezvous.fleet_reports(client, keys) == {}
            await rendezvous.report_version(client, keys, "rollout-0", "127.0.0.1:7000", 1)
            await rendezvous.report_version(client, keys, "rollout-1", "127.0.0.1:7001", 1)
            await rendezvous.report_version(
                client, keys, "rollout-0", "127.0.0.1:7000", 1, ReportStatus.STALE, "fetch timed out"
            )
            await rendezvous.report_version(client, keys, "rollout-1", "127.0.0.1:7001", 2)
            return await rendezvous.fleet_reports(client, keys)
        finally:
            await client.aclose()

    reports = asyncio.run(scenario())
    assert sorted(reports) == ["rollout-0", "rollout-1"]
    zero, one = reports["rollout-0"], reports["rollout-1"]
    assert (zero.server_id, zero.address, zero.policy_version) == ("rollout-0", "127.0.0.1:7000", 1)
    assert zero.status is ReportStatus.STALE and zero.message == "fetch timed out"
    assert (one.policy_version, one.status, one.message) == (2, ReportStatus.OK, "")
    assert abs(one.time_s - time.time()) < 60
