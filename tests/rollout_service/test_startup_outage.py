"""A rollout server whose first fleet report meets a Redis outage (real valkey behind the fault proxy, the synthetic
engine in process): the server waits for Redis instead of exiting, and registers once it is back."""

from __future__ import annotations

import argparse
import asyncio

import pytest
import redis
import redis.asyncio as aioredis

from channels.version_board import VersionBoard
from protos.config import RolloutConfig, WeightBusConfig
from protos.redis_keys import RedisKeys
from rollout_service.__main__ import announce
from rollout_service.synthetic_engine import SyntheticEngine
from rollout_service.weight_sync import WeightFollower
from tests.redis_faults import redis_proxy
from tests.waiting import wait_until_async

pytestmark = pytest.mark.integration


def test_a_server_started_during_an_outage_registers_once_redis_is_back(redis_url):
    keys = RedisKeys("startup-outage")
    engine = SyntheticEngine("", RolloutConfig(engine="synthetic"), server_id="late-0")
    args = argparse.Namespace(metrics_port=0, address_file="")

    async def scenario(proxy_url: str, proxy) -> None:
        client = aioredis.Redis.from_url(proxy_url, socket_timeout=5)
        follower = WeightFollower(engine, client, keys, WeightBusConfig(), "")
        proxy.cut()  # the outage begins before the server's first report
        started = asyncio.create_task(announce(args, engine, follower, "127.0.0.1", 7123))
        # a few refused attempts; the long chaos soak's server exited on the first
        await wait_until_async(lambda: proxy.refused >= 3, "three refused attempts to register", 30)
        assert not started.done(), "the server gave up (or registered) while Redis was unreachable"
        proxy.restore()
        await asyncio.wait_for(started, timeout=60)
        await client.aclose()

    with redis_proxy(redis_url) as (proxy_url, proxy):
        asyncio.run(scenario(proxy_url, proxy))
        assert proxy.refused > 0  # the outage was met
    reports = VersionBoard(redis.Redis.from_url(redis_url), keys).fleet_reports()
    assert reports["late-0"].address == "127.0.0.1:7123" and reports["late-0"].policy_version == 0
