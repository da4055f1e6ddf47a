"""The coordinator's routing in process: the one-pass server pick, health sweeps that skip servers whose call just
succeeded, the latency histograms and their PromQL-style quantiles, and the dispatch hook of Fleet.generate."""

from __future__ import annotations

import asyncio
import math
import time

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from coordinator.fleet import Fleet, FleetWatcher
from coordinator.latency import LatencyHistogram, quantile
from coordinator.rollout_client import RolloutClient

pytestmark = pytest.mark.unit


def clients(count: int, version: int = 3) -> list[RolloutClient]:
    made = []
    for index in range(count):
        client = RolloutClient(f"127.0.0.1:{40000 + index}")  # channels connect lazily: nothing is dialled here
        client.policy_version = version
        made.append(client)
    return made


def least_loaded(fleet: Fleet, accept, exclude: set[str]) -> RolloutClient | None:
    """The rule the pick keeps: among accepted healthy servers, the first least loaded outside ``exclude``, else
    the first least loaded inside it."""
    eligible = [c for c in fleet.clients if c.healthy and accept(c)]
    fresh = [c for c in eligible if c.address not in exclude]
    return min(fresh or eligible, key=lambda c: c.inflight) if eligible else None


def in_loop(check) -> None:
    """Run ``check()`` inside an event loop: gRPC's asyncio channels are made on the loop that uses them."""

    async def run() -> None:
        check()

    asyncio.run(run())


def test_the_one_pass_pick_chooses_what_the_least_loaded_rule_chooses():
    in_loop(pick_matches_the_rule)


def pick_matches_the_rule() -> None:
    rng = np.random.default_rng(0)
    fleet = Fleet(clients(64))
    for _ in range(300):
        for client in fleet.clients:
            client.inflight = int(rng.integers(0, 3))
            client.healthy = bool(rng.random() > 0.1)
            client.policy_version = int(rng.integers(0, 4))
        floor = int(rng.integers(0, 4))
        exclude = {c.address for c in fleet.clients if rng.random() < 0.3}
        accept = lambda c, floor=floor: c.policy_version >= floor  # noqa: E731
        assert fleet.pick_now(accept, exclude) is least_loaded(fleet, accept, exclude)


def test_the_pick_stops_at_the_first_idle_server():
    in_loop(pick_stops_early)


def pick_stops_early() -> None:
    fleet = Fleet(clients(256))
    asked: list[str] = []

    def accept(client: RolloutClient) -> bool:
        asked.append(client.address)
        return True

    fleet.clients[0].inflight = 2
    assert fleet.pick_now(accept, set()) is fleet.clients[1]
    assert len(asked) == 2, "an idle server was found second: the other 254 need no look"
    assert Fleet(clients(3, version=1)).pick_now(lambda c: c.policy_version >= 2, set()) is None


def test_generate_reports_the_wait_for_an_accepted_server_to_the_dispatch_hook():
    waits: list[float] = []

    async def scenario():
        fleet = Fleet(clients(1, version=0))

        async def promote():
            await asyncio.sleep(0.2)  # kept: the wait that generate() must measure and report
            fleet.clients[0].policy_version = 1
            fleet.notify_changed()

        promoter = asyncio.create_task(promote())
        with pytest.raises(Exception):  # noqa: B017 - nothing listens at the address: the call itself fails
            await fleet.generate([1], 1, None, lambda c: c.policy_version >= 1, "v >= 1", "r", 0.5, 1, waits.append)
        await promoter
        await fleet.close()

    asyncio.run(scenario())
    assert len(waits) == 1 and 0.15 <= waits[0] < 1.0


def test_a_health_sweep_skips_healthy_servers_whose_call_just_succeeded():
    async def scenario() -> list[bool]:
        fleet = Fleet(clients(3))
        fleet.clients[0].last_success_s = time.monotonic()  # proven alive a moment ago
        fleet.clients[1].last_success_s = time.monotonic() - 60  # long ago: checked
        fleet.clients[2].last_success_s = time.monotonic()
        fleet.clients[2].healthy = False  # unhealthy ones are always checked
        watcher = FleetWatcher(fleet, lambda version: None, client=None, keys=None)
        await watcher.check_health(proven_within_s=2.0)
        await fleet.close()
        return [c.healthy for c in fleet.clients]

    # nothing listens at these addresses: a checked server is unhealthy now, a skipped one kept its state
    assert asyncio.run(scenario()) == [True, False, False]


def test_histogram_buckets_follow_prometheus_le_and_quantiles_interpolate_like_promql():
    histogram = LatencyHistogram(bounds_s=(0.001, 0.002, 0.005))
    for seconds in (0.0005, 0.001, 0.0015, 0.004, 0.004, 0.1):
        histogram.observe(seconds)
    assert histogram.cumulative() == [(0.001, 2), (0.002, 3), (0.005, 5), (math.inf, 6)]
    assert histogram.count == 6 and histogram.sum_s == pytest.approx(0.111)
    assert quantile(0.5, histogram.cumulative()) == pytest.approx(0.002)  # rank 3: the top of the 2nd bucket
    assert quantile(0.25, histogram.cumulative()) == pytest.approx(0.00075)  # rank 1.5 inside [0, 1 ms]
    assert quantile(0.99, histogram.cumulative()) == 0.005  # in +Inf: the highest finite bound
    assert math.isnan(quantile(0.5, LatencyHistogram().cumulative()))
    with pytest.raises(ValueError, match="distinct and increasing"):
        LatencyHistogram(bounds_s=(0.002, 0.001))


def test_quantiles_of_the_default_buckets_are_close_to_the_exact_ones():
    rng = np.random.default_rng(1)
    samples = rng.lognormal(mean=np.log(0.002), sigma=0.6, size=20000)
    histogram = LatencyHistogram()
    for seconds in samples:
        histogram.observe(float(seconds))
    for q in (0.5, 0.9, 0.99):
        exact = float(np.quantile(samples, q))
        assert quantile(q, histogram.cumulative()) == pytest.approx(exact, rel=0.15)


def test_the_collector_exports_both_latency_histograms():
    from coordinator.metrics import CoordinatorCollector
    from tests.coordinator.test_coordinator_core import make_scheduler

    scheduler = make_scheduler()
    scheduler.dispatch_latency.observe(0.003)
    scheduler.routing_latency.observe(0.0004)

    class Reporter:  # what the collector reads of a MetricsReporter
        queue_depth, evals, tokens_per_s = 0, None, 0.0

    Reporter.scheduler = scheduler
    registry = CollectorRegistry(auto_describe=False)
    registry.register(CoordinatorCollector(Reporter()))
    text = generate_latest(registry).decode()
    assert 'coordinator_dispatch_latency_s_bucket{le="0.003"} 1.0' in text
    assert 'coordinator_routing_latency_s_bucket{le="0.0005"} 1.0' in text
    assert "coordinator_dispatch_latency_s_count 1.0" in text
