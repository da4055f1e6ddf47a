"""Health Watch streams (coordinator/health_watch.py) against real stand-in rollout servers: a draining fleet is
seen at once, a server that comes back on its address is healthy again, and a sweep skips watched servers."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
import redis.asyncio as aioredis

from coordinator.fleet import Fleet, FleetWatcher
from coordinator.rollout_client import RolloutClient
from launcher.redis_server import free_port
from protos.records import ReportStatus, VersionReport, encode
from protos.redis_keys import RedisKeys
from rollout_service import standin_fleet
from tests.waiting import wait_until_async

pytestmark = pytest.mark.integration


def test_a_draining_fleet_is_seen_unhealthy_at_once_without_a_sweep(tmp_path):
    spawned = standin_fleet.spawn(2, tmp_path / "fleet.log", "--grace-s", "3")
    addresses = spawned.wait_serving(timeout_s=120)

    async def scenario() -> float:
        fleet = Fleet([RolloutClient(address) for address in addresses])
        watcher = FleetWatcher(fleet, lambda version: None, client=None, keys=None)
        stop = asyncio.Event()
        watcher.health_watches.reconcile(stop)
        try:
            await wait_until_async(lambda: all(map(watcher.health_watches.watching, fleet.clients)), "both watched", 10)
            spawned.process.send_signal(15)  # SIGTERM: NOT_SERVING, then a grace period of 3 s before it stops
            signalled = time.monotonic()
            await wait_until_async(lambda: not any(c.healthy for c in fleet.clients), "both unhealthy", 10)
            return time.monotonic() - signalled
        finally:
            stop.set()
            await watcher.health_watches.close()
            await fleet.close()

    try:
        seconds = asyncio.run(scenario())
    finally:
        assert spawned.stop() == 0
    assert seconds < 2.0, "the drain was seen by the sweep (every 2 s), not pushed by the servers"


def test_a_server_back_on_its_address_is_healthy_again_with_its_version_read_first(tmp_path):
    port = free_port()
    first = standin_fleet.spawn(1, tmp_path / "first.log", "--base-port", str(port), "--grace-s", "0")
    address = first.wait_serving(timeout_s=120)[0]

    async def scenario() -> None:
        fleet = Fleet([RolloutClient(address)])
        client = fleet.clients[0]
        watcher = FleetWatcher(fleet, lambda version: None, client=None, keys=None)
        stop = asyncio.Event()
        watcher.health_watches.reconcile(stop)
        try:
            await wait_until_async(lambda: watcher.health_watches.watching(client), "watched", 10)
            assert first.stop() == 0
            await wait_until_async(lambda: not client.healthy, "unhealthy once stopped", 10)
            client.policy_version = 7  # the version the coordinator last saw; the new process serves v0
            second = standin_fleet.spawn(1, tmp_path / "second.log", "--base-port", str(port), "--grace-s", "0")
            try:
                await asyncio.to_thread(second.wait_serving, 120)
                await wait_until_async(lambda: client.healthy and watcher.health_watches.watching(client), "back", 10)
                assert client.policy_version == 0, "routable again before its version was read"
            finally:
                assert second.stop() == 0
        finally:
            stop.set()
            await watcher.health_watches.close()
            await fleet.close()

    asyncio.run(scenario())


def test_a_sweep_checks_the_unhealthy_even_when_watched_and_skips_the_rest(tmp_path):
    spawned = standin_fleet.spawn(2, tmp_path / "fleet.log")
    addresses = spawned.wait_serving(timeout_s=120)

    async def scenario() -> list[bool]:
        fleet = Fleet([RolloutClient(address) for address in addresses])
        watcher = FleetWatcher(fleet, lambda version: None, client=None, keys=None)
        stop = asyncio.Event()
        watcher.health_watches.reconcile(stop)
        try:
            await wait_until_async(lambda: all(map(watcher.health_watches.watching, fleet.clients)), "both watched", 10)
            fleet.clients[0].healthy = False  # as a failed call marks it: its stream has nothing new to say
            await watcher.check_health()
            return [client.healthy for client in fleet.clients]
        finally:
            stop.set()
            await watcher.health_watches.close()
            await fleet.close()

    try:
        assert asyncio.run(scenario()) == [True, True]  # the sweep found the first serving again
    finally:
        assert spawned.stop() == 0


def test_the_fleet_reports_are_read_only_when_they_can_have_changed(redis_url):
    keys = RedisKeys("refresh-test")
    sync_client = redis.Redis.from_url(redis_url)

    def report(version: int) -> None:
        for index in range(3):
            record = VersionReport(f"s{index}", f"127.0.0.1:{41000 + index}", version, ReportStatus.OK, "", time.time())
            sync_client.hset(keys.fleet, f"s{index}", encode(record))
        sync_client.set(keys.policy_version, version)

    def reads() -> int:
        return sync_client.info("commandstats").get("cmdstat_hgetall", {}).get("calls", 0)

    async def scenario() -> list[int]:
        client = aioredis.Redis.from_url(redis_url)
        fleet = Fleet([RolloutClient(f"127.0.0.1:{41000 + index}") for index in range(3)])
        watcher = FleetWatcher(fleet, lambda version: None, client, keys)
        counts = []
        report(1)
        sync_client.config_resetstat()
        await watcher.refresh()  # a new trainer version: read
        await watcher.refresh()  # nothing can have changed: not read
        counts.append(reads())
        sync_client.set(keys.policy_version, 2)
        await watcher.refresh()  # a new version, every server behind it: read
        await watcher.refresh()  # still behind: read again
        counts.append(reads())
        report(2)
        await watcher.refresh()  # caught up (read: they were behind)
        await watcher.refresh()  # not read
        counts.append(reads())
        counts.append([c.policy_version for c in fleet.clients])
        await fleet.close()
        await client.aclose()
        return counts

    assert asyncio.run(scenario()) == [1, 3, 4, [2, 2, 2]]


def test_a_coordinator_that_cannot_read_the_checkpoint_takes_the_context_length_its_servers_serve(tmp_path):
    from coordinator.discovery import served_max_model_len
    from protos.config import RunConfig

    # the coordinator's machine has no files at model_path: its max_model_len stays unresolved
    config = RunConfig(model_path=str(tmp_path / "mounted-only-on-the-rollout-hosts"))
    assert config.rollout.max_model_len is None
    spawned = standin_fleet.spawn(1, tmp_path / "fleet.log")
    addresses = spawned.wait_serving(timeout_s=120)

    async def scenario():
        fleet = Fleet([RolloutClient(address) for address in addresses])
        try:
            served = await served_max_model_len(fleet, config.coordinator.sampling.max_tokens)
            with pytest.raises(
                ValueError, match=r"sampling.max_tokens must be below rollout.max_model_len \(256 >= 256"
            ):
                await served_max_model_len(fleet, 256)
            return served
        finally:
            await fleet.close()

    try:
        assert asyncio.run(scenario()) == 256  # the stand-in serves the demo's 256
    finally:
        assert spawned.stop() == 0
