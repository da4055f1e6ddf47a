"""A coordinator started while Redis is away (restarting, cut off) waits for it instead of failing: the chaos soak saw
a coordinator restarted after a kill exit with a connection error because valkey restarted during its start, and the
launcher had to restart it once more. Its Redis is reached through the fault proxy of tests/redis_faults.py."""

from __future__ import annotations

import asyncio
import threading

import pytest
import redis
import redis.asyncio as aioredis

from channels.version_board import AsyncVersionBoard
from coordinator.__main__ import build_pipeline
from coordinator.discovery import FleetDiscovery, wait_for_servers
from coordinator.fleet import Fleet
from protos.config import load_run_config
from protos.records import PromptCursor, encode
from protos.redis_keys import RedisKeys
from tests.redis_faults import redis_proxy
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

KEYS = RedisKeys("start-outage")


def restore_once_refused(proxy, timeout_s: float = 30.0) -> threading.Thread:
    """Ends the outage once the coordinator has been refused a connection (it tried while Redis was away)."""

    def restore() -> None:
        try:
            wait_until(lambda: proxy.refused, "a connection of the coordinator refused", timeout_s)
        finally:
            proxy.restore()

    thread = threading.Thread(target=restore, daemon=True)
    thread.start()
    return thread


def test_waiting_for_servers_to_register_rides_out_a_redis_outage_until_its_deadline(redis_url):
    with redis_proxy(redis_url) as (proxy_url, proxy):
        proxy.cut()
        client = aioredis.Redis.from_url(proxy_url, socket_timeout=5)
        fleet = Fleet([])

        async def wait() -> None:
            try:
                await wait_for_servers(fleet, FleetDiscovery(fleet, 10.0), AsyncVersionBoard(client, KEYS), 2.0)
            finally:
                await client.aclose()

        # no server ever registers: the wait ends at its deadline naming the fleet key, not at the first refusal
        with pytest.raises(TimeoutError, match=r"no rollout server registered in Redis \(fleetrl:start-outage:fleet\)"):
            asyncio.run(wait())
        assert proxy.refused > 0


def test_a_restarted_coordinators_start_reads_wait_for_redis(redis_url):
    direct = redis.Redis.from_url(redis_url)
    direct.set(KEYS.policy_version, 2)
    direct.set(KEYS.version_offset, 0)
    for _ in range(12):  # 12 groups pushed by the coordinator before, 4 per step, the trainer took 2 steps
        direct.xadd(KEYS.trajectories, {"g": b"x"})
    direct.set(KEYS.prompt_cursor, encode(PromptCursor("echo", "echo-12-11", {"seed": 0, "draws": 12})))
    config = load_run_config(overrides=["run_id=start-outage", "groups_per_step=4", "num_steps=10"])
    with redis_proxy(redis_url) as (proxy_url, proxy):
        proxy.cut()
        restorer = restore_once_refused(proxy)

        async def build():
            client = aioredis.Redis.from_url(proxy_url, socket_timeout=5)
            try:
                return await build_pipeline(config, client, KEYS, Fleet([]))
            finally:
                await client.aclose()

        pipeline = asyncio.run(build())
        restorer.join(timeout=10)
        pipeline.executor.shutdown()
    scheduler = pipeline.scheduler
    assert proxy.refused > 0
    assert (scheduler.start_version, scheduler.pushed_before, scheduler.total_groups) == (2, 12, 10 * 4 - 12)
    assert scheduler.queued_at_start == 12 - 2 * 4
    assert scheduler.task.cursor() == {"seed": 0, "draws": 12}  # the prompt stream continues after the cursor
