"""Rollout-busy seconds: how long a server had a Generate call of the coordinator open (the async benchmark's
rollout-busy fraction comes from them), against a real rollout server process."""

from __future__ import annotations

import asyncio
import time

import pytest

from coordinator.metrics import rollout_busy_s
from coordinator.rollout_client import RolloutClient
from protos.config import SamplingConfig

pytestmark = pytest.mark.integration

SAMPLING = SamplingConfig(max_tokens=32, temperature=1.0)


def test_busy_seconds_count_time_with_a_call_open_once_however_many_overlap(rollout_server):
    async def scenario():
        client, idle = RolloutClient(rollout_server.address), RolloutClient("127.0.0.1:1")  # idle: never called
        try:
            assert client.busy_s() == 0.0
            started = time.monotonic()
            await asyncio.gather(*(client.generate([1, 4, 5, 6], 4, SAMPLING, timeout_s=120) for _ in range(3)))
            wall = time.monotonic() - started
            after_calls = client.busy_s()
            later = client.busy_s(now=time.monotonic() + 60)  # nothing open: the count stands still
            return wall, after_calls, later, rollout_busy_s([client, idle]), client.inflight
        finally:
            await client.close()
            await idle.close()

    wall, after_calls, later, fleet_mean, inflight = asyncio.run(scenario())
    assert inflight == 0
    # Three overlapping calls count their union once: at most the wall time they took, not three times it.
    assert 0 < after_calls <= wall
    assert later == after_calls
    assert fleet_mean == pytest.approx(after_calls / 2)  # averaged over the routable servers
