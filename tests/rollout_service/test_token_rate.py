"""The rollout tokens/s an operator reads: a windowed rate of tokens counted as they are generated, one figure in the
server's reports, its heartbeat, the coordinator's fleet sum and Prometheus."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import redis.asyncio as aioredis
from prometheus_client import REGISTRY

from channels.version_board import AsyncVersionBoard
from coordinator.fleet import Fleet, FleetWatcher
from coordinator.metrics import fleet_tokens_per_s
from coordinator.rollout_client import RolloutClient
from protos.records import ROLLOUT_RATE_WINDOW_S, ReportStatus, VersionReport
from protos.redis_keys import RedisKeys
from rollout_service import metrics
from rollout_service.metrics import WindowedRate
from tests.waiting import wait_until_async

pytestmark = pytest.mark.integration  # one test reads real Redis


def test_a_steady_stream_reads_its_exact_rate():
    rate = WindowedRate(10.0)
    readings = [rate.update(float(t), 250 * t) for t in range(30)]
    assert readings[0] == 0.0
    assert all(r == pytest.approx(250.0) for r in readings[1:])


def test_a_burst_is_spread_over_the_window_instead_of_jumping_between_zero_and_peaks():
    rate, total, readings = WindowedRate(10.0), 0, []
    for t in range(40):  # 1,000 tokens land every 4 s (responses finishing together), read every second
        total += 1000 if t % 4 == 0 else 0
        readings.append(rate.update(float(t), total))
    steady = readings[12:]
    assert min(steady) >= 200 and max(steady) <= 300  # the mean is 250; unsmoothed, 0 and 1,000 alternate
    later = [rate.update(40.0 + t, total) for t in range(1, 13)]
    assert later[-1] == 0.0  # a window after the last token the rate is 0 again


def test_the_coordinators_fleet_rate_is_the_sum_of_the_rates_the_servers_report(redis_url):
    keys = RedisKeys("rate")

    async def scenario():
        client = aioredis.Redis.from_url(redis_url)
        servers = [RolloutClient("127.0.0.1:1"), RolloutClient("127.0.0.1:2"), RolloutClient("127.0.0.1:3")]
        watcher = FleetWatcher(Fleet(servers), lambda version: None, client, keys, interval_s=0.05)
        board = AsyncVersionBoard(client, keys)
        for number, rate in ((1, 1200.0), (2, 300.5)):  # the third server reports nothing: it adds 0
            report = VersionReport(f"r{number}", f"127.0.0.1:{number}", 0, ReportStatus.OK, "", time.time())
            await board.report_version(msgspec.structs.replace(report, tokens_per_s=rate))
        task = asyncio.create_task(watcher.run(asyncio.Event()))
        try:
            await wait_until_async(
                lambda: fleet_tokens_per_s(servers) == pytest.approx(1500.5), "the fleet rate 1500.5 tokens/s", 30
            )
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            for server in servers:
                await server.close()
            await client.aclose()

    asyncio.run(scenario())


def test_the_prometheus_gauge_reads_the_same_window_as_the_reports():
    before = metrics.tokens_generated_total()
    metrics.count_generated(5)
    assert metrics.tokens_generated_total() == before + 5
    gauge = REGISTRY.get_sample_value("rollout_tokens_per_s")
    assert gauge is not None and gauge >= 0.0
    assert metrics.RATE_WINDOW_S == ROLLOUT_RATE_WINDOW_S
