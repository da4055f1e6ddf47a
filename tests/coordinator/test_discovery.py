"""Discovery against a real rollout server that beats into a real Redis: it registers (address, version, load,
capacity), the coordinator's fleet adds it, drops it once its beat is too old or its entry is gone, and keeps an
operator's removal. The module's one server is stopped by the last test."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import redis.asyncio as aioredis

from channels.trajectory_stream import TrajectoryStreamWriter
from channels.version_board import AsyncVersionBoard
from coordinator.admin import AdminCore
from coordinator.control import ControlChannel
from coordinator.discovery import FleetDiscovery
from coordinator.fleet import Fleet
from coordinator.metrics import MetricsReporter
from coordinator.rollout_client import RolloutClient
from coordinator.scheduler import Scheduler
from coordinator.tasks import EchoTask
from protos.config import load_run_config
from protos.redis_keys import RedisKeys
from tests.rollout_service.server_process import spawn_rollout_server, stop_process
from tests.waiting import wait_until_async

pytestmark = pytest.mark.integration

RUN_ID = "discovery-test"
KEYS = RedisKeys(RUN_ID)
TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def beating_server(tiny_model, redis_server, tmp_path_factory):
    """A rollout server registered in RUN_ID's fleet hash, beating every 0.2 s."""
    server = spawn_rollout_server(
        tiny_model,
        tmp_path_factory.mktemp("logs") / "rollout.log",
        "--server-id",
        "beater",
        "--redis-url",
        redis_server.url,
        "--run-id",
        RUN_ID,
        "rollout.heartbeat_interval_s=0.2",
        "rollout.max_num_seqs=32",
    )
    try:
        yield server.wait_serving(timeout_s=300)
    finally:
        stop_process(server.process)


async def _reports(url: str) -> dict:
    client = aioredis.Redis.from_url(url)
    try:
        return await AsyncVersionBoard(client, KEYS).fleet_reports()
    finally:
        await client.aclose()


async def _fresh_reports(url: str, timeout_s: float = 30.0) -> dict:
    """The fleet hash once it holds the beater's entry (a test before may have flushed Redis)."""

    async def registered() -> dict | None:
        reports = await _reports(url)
        return reports if "beater" in reports else None

    return await wait_until_async(registered, "the beater's registration", timeout_s)


def test_a_serving_server_beats_its_address_version_load_and_capacity(beating_server, redis_url):
    async def scenario():
        first = (await _fresh_reports(redis_url))["beater"]

        async def renewed():
            later = (await _reports(redis_url))["beater"]
            return later if later.time_s != first.time_s else None

        return first, await wait_until_async(renewed, "the beater's registration renewed", 10)

    first, later = asyncio.run(scenario())
    assert later.address == first.address == beating_server.address
    assert later.capacity == 32 and later.running == 0 and later.waiting == 0 and later.policy_version == 0
    assert 0 < later.time_s - first.time_s < TIMEOUT_S and abs(time.time() - later.time_s) < TIMEOUT_S


def test_discovery_adds_a_beating_server_and_leaves_servers_outside_the_registry_alone(beating_server, redis_url):
    async def scenario():
        reports = await _fresh_reports(redis_url)
        outside = RolloutClient("127.0.0.1:1")  # listed with --servers, never registered
        fleet = Fleet([outside])
        discovery = FleetDiscovery(fleet, TIMEOUT_S)
        await discovery.refresh(reports)
        await discovery.refresh(reports, now_s=time.time() + 10 * TIMEOUT_S)  # every beat long overdue
        addresses = [c.address for c in fleet.clients]
        await fleet.close()
        return addresses, [c.address for c in fleet.retired], discovery.num_added

    addresses, retired, num_added = asyncio.run(scenario())
    assert num_added == 1 and addresses == ["127.0.0.1:1"]  # added, then dropped: the outside server stays
    assert retired == [beating_server.address]


def test_a_server_dropped_for_a_late_beat_rejoins_when_it_beats_again(beating_server, redis_url):
    async def scenario():
        fleet = Fleet([])
        discovery = FleetDiscovery(fleet, TIMEOUT_S)
        reports = await _fresh_reports(redis_url)
        await discovery.refresh(reports)
        joined = fleet.find(beating_server.address)
        await discovery.refresh(reports, now_s=reports["beater"].time_s + TIMEOUT_S + 1)
        dropped = [c.address for c in fleet.clients]
        await discovery.refresh(await _reports(redis_url))  # a beat on time
        rejoined = fleet.find(beating_server.address)
        await fleet.close()
        return joined, dropped, rejoined, fleet.retired

    joined, dropped, rejoined, retired = asyncio.run(scenario())
    assert joined is not None and joined.server_id == "beater" and joined.healthy
    assert dropped == [] and retired == [joined]  # dropped with the last server: it is dead, nothing to keep
    assert rejoined is not None and rejoined is not joined


def test_an_operator_removal_outlasts_the_server_beating_even_at_a_new_address(beating_server, redis_url):
    async def scenario():
        client = aioredis.Redis.from_url(redis_url)
        run = load_run_config(overrides=[f"run_id={RUN_ID}"])
        fleet = Fleet([])
        discovery = FleetDiscovery(fleet, TIMEOUT_S)
        scheduler = Scheduler(run, fleet, TrajectoryStreamWriter(client, KEYS), EchoTask(), 8)
        reporter = MetricsReporter(scheduler, None, scheduler.queue, client, KEYS)
        core = AdminCore(run, scheduler, reporter, ControlChannel(client, KEYS), None, discovery)
        reports = await _fresh_reports(redis_url)
        await discovery.refresh(reports)
        fleet.clients.append(RolloutClient("127.0.0.1:1"))  # another server, so the operator may remove one
        core.remove_server(beating_server.address)  # fleetrl servers remove
        await discovery.refresh(await _reports(redis_url))
        after_remove = fleet.find(beating_server.address)
        # The same server restarted elsewhere registers its new address under its id: still the operator's call.
        moved = {"beater": msgspec.structs.replace(reports["beater"], address="127.0.0.1:2", time_s=time.time())}
        await discovery.refresh(moved)
        after_move = fleet.find("127.0.0.1:2")
        await core.add_server(beating_server.address)  # fleetrl servers add: the operator takes it back
        await discovery.refresh(await _reports(redis_url))
        back = fleet.find(beating_server.address)
        await fleet.close()
        await client.aclose()
        return after_remove, after_move, back, discovery.operator_removed

    after_remove, after_move, back, still_removed = asyncio.run(scenario())
    assert after_remove is None and after_move is None
    assert back is not None and back.server_id == "beater" and still_removed == {}


# Keep this test last: it stops the module's server.
def test_a_stopping_server_leaves_the_fleet_hash_and_is_dropped_at_once(beating_server, redis_url):
    async def scenario():
        fleet = Fleet([])
        discovery = FleetDiscovery(fleet, timeout_s=3600.0)  # only the removed entry can drop it
        await discovery.refresh(await _fresh_reports(redis_url))
        joined = [c.address for c in fleet.clients]
        await asyncio.to_thread(stop_process, beating_server.process)  # SIGTERM: graceful stop
        reports = await _reports(redis_url)
        await discovery.refresh(reports)
        left = [c.address for c in fleet.clients]
        await fleet.close()
        return joined, reports, left

    joined, reports, left = asyncio.run(scenario())
    assert joined == [beating_server.address]
    assert "beater" not in reports and left == []
