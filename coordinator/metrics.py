"""The coordinator's figures: periodic MetricsReports on Redis and Prometheus ``/metrics``.

``MetricsReporter`` writes one ``MetricsReport("coordinator", ...)`` a second onto the run's metrics
stream (channels/metrics_stream.py; the dashboard and the demo read it) and one per eval round
(``eval/<dataset>/acc`` ...). The Prometheus names are the ones ``deploy/grafana/fleetrl-dashboard.json``
and the alert rules (``deploy/prometheus/alerts.yml``) query.
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from channels.metrics_stream import AsyncMetricsStreamReader, AsyncMetricsStreamWriter
from channels.retry import UNREACHABLE
from channels.trajectory_stream import TrajectoryStreamWriter
from coordinator.evaluation import EvalRunner
from coordinator.scheduler import Scheduler
from protos.records import ROLLOUT_RATE_WINDOW_S, MetricsReport
from protos.redis_keys import RedisKeys

logger = logging.getLogger(__name__)


class MetricsReporter:
    """Periodic figures of the scheduler; keeps the latest rates for ``fleetrl status`` and /metrics."""

    def __init__(
        self,
        scheduler: Scheduler,
        evals: EvalRunner | None,
        queue: TrajectoryStreamWriter,
        client: aioredis.Redis,
        keys: RedisKeys,
    ):
        self.scheduler = scheduler
        self.evals = evals
        self.queue = queue
        self.client = client
        self.keys = keys
        self.stream = AsyncMetricsStreamWriter(client, keys)
        self.started = time.monotonic()
        self.tokens_per_s = 0.0
        self.groups_per_s = 0.0
        self.queue_depth = 0

    def values(self) -> dict[str, float]:
        s, stats = self.scheduler, self.scheduler.stats
        values = {
            "tokens_per_s": self.tokens_per_s,
            "groups_per_s": self.groups_per_s,
            "groups_admitted": stats.groups_admitted,
            "slots_admitted": stats.slots_admitted,
            "admission_limit": s.admission_limit(),
            "groups_pushed": stats.groups_pushed,
            "groups_in_flight": len(s.in_flight),
            "groups_skipped": stats.groups_skipped,
            "groups_kept_uniform": stats.groups_kept_uniform,
            "samples_pushed": stats.samples_pushed,
            "redispatches": s.fleet.redispatches,
            "reward_errors": stats.reward_errors,
            "queue_depth": self.queue_depth,
            "mean_reward": stats.reward_sum / max(1, stats.samples_pushed),
            "max_staleness_at_push": stats.max_staleness_at_push,
            "agent_groups_dropped": stats.agent_groups_dropped,
            "agent_turns_lost": stats.agent_turns_lost,
            "prompts_too_long": getattr(s.task, "prompts_too_long", 0),
            "uptime_s": time.monotonic() - self.started,
            "rollout_busy_s": rollout_busy_s(s.fleet.clients),
        }
        if self.evals is not None:
            values["eval_samples_discarded"] = self.evals.samples_discarded
        return {k: float(v) for k, v in values.items()}

    async def report(self) -> bool:
        """One periodic report; while Redis is unreachable it is skipped (logged): the next one is the retry."""
        stats = self.scheduler.stats
        report = MetricsReport(
            "coordinator", stats.groups_pushed, self.scheduler.trainer_version, time.time(), self.values()
        )
        return await self.stream.post(report)

    async def report_eval(self, version: int, values: dict[str, float]) -> bool:
        """The figures of an eval round (an XADD, not retried: not idempotent; the round's figures are logged)."""
        step = version - self.scheduler.version_offset  # the trainer's steps at that version (the run's, not ours)
        values = {**values, "eval/version": version}
        return await self.stream.post(MetricsReport("coordinator", step, version, time.time(), values))

    async def run(self, stop: asyncio.Event, interval_s: float = 1.0) -> None:
        last_groups, last_time = 0, time.monotonic()
        while True:
            try:
                await asyncio.wait_for(stop.wait(), timeout=interval_s)
            except TimeoutError:
                pass
            now, stats = time.monotonic(), self.scheduler.stats
            # The fleet's rate is the sum of the servers' own (counted as they generate, over their window), so
            # the console, the dashboard, `fleetrl status` and Prometheus show one figure; counting here, when a
            # response completes, jumped between 0 and several times the mean from one second to the next.
            self.tokens_per_s = fleet_tokens_per_s(self.scheduler.fleet.clients)
            self.groups_per_s = (stats.groups_pushed - last_groups) / max(1e-6, now - last_time)
            last_groups, last_time = stats.groups_pushed, now
            try:
                self.queue_depth = await self.queue.depth()
            except UNREACHABLE as error:  # periodic: the next report reads it again
                logger.warning("queue depth not read, Redis unreachable: %s", error)
            await self.report()
            if stop.is_set():  # one last report after the stop so the totals are final
                return


def fleet_tokens_per_s(clients) -> float:
    """The fleet's generation rate: the sum of the rates its servers reported last (each over its own window)."""
    return sum(client.tokens_per_s for client in clients)


def rollout_busy_s(clients) -> float:
    """Seconds the routable servers had a call of ours open, averaged over them (cumulative since start): with the
    uptime, the fraction of the run the rollout side was generating."""
    now = time.monotonic()
    return sum(client.busy_s(now) for client in clients) / max(1, len(clients))


class CoordinatorCollector:
    """Prometheus collector reading the live scheduler at scrape time."""

    def __init__(self, reporter: MetricsReporter):
        self.reporter = reporter

    def collect(self):
        reporter, scheduler = self.reporter, self.reporter.scheduler
        stats = scheduler.stats
        counters = {
            "coordinator_groups_admitted": (stats.groups_admitted, "Prompts admitted (replacements included)."),
            "coordinator_groups_pushed": (stats.groups_pushed, "Groups pushed onto the trajectory stream."),
            "coordinator_groups_skipped": (stats.groups_skipped, "Groups skipped by dynamic sampling."),
            "coordinator_redispatches": (scheduler.fleet.redispatches, "Generate calls retried on another server."),
            "coordinator_generated_tokens": (stats.tokens_generated, "Response tokens received."),
        }
        for name, (value, doc) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)
        gauges = {
            "coordinator_queue_depth": (reporter.queue_depth, "Groups on the stream not yet delivered to the trainer."),
            "coordinator_trainer_policy_version": (scheduler.trainer_version, "Trainer's latest published version."),
            "coordinator_groups_in_flight": (len(scheduler.in_flight), "Admitted group slots not yet pushed."),
            "coordinator_max_staleness": (scheduler.run.max_staleness, "The staleness bound k in force."),
            "coordinator_rollout_tokens_per_s": (
                reporter.tokens_per_s,
                f"The fleet's generated tokens/s: the sum of the servers' rates, each over its last "
                f"{ROLLOUT_RATE_WINDOW_S:g} s.",
            ),
        }
        for name, (value, doc) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        yield from queue_bound_gauges(scheduler)
        yield from latency_histograms(scheduler)
        accuracy = GaugeMetricFamily("coordinator_eval_accuracy", "Latest eval mean accuracy.", labels=["dataset"])
        if reporter.evals is not None:
            for key, value in reporter.evals.latest.items():
                if key.startswith("eval/") and key.endswith("/acc"):
                    accuracy.add_metric([key[len("eval/") : -len("/acc")]], value)
        yield accuracy


def queue_bound_gauges(scheduler: Scheduler):
    """What the alert rules (deploy/prometheus/alerts.yml) compare the queue depth with: under admission control at
    most (k + 1) * B groups wait for a trainer on version v, so a queue far above that grows without bound."""
    yield GaugeMetricFamily(
        "coordinator_groups_per_step", "Groups per training step B in force.", value=scheduler.run.groups_per_step
    )


def latency_histograms(scheduler: Scheduler):
    """Admission -> dispatch of each group (``Scheduler.dispatch_latency`` and ``routing_latency``)."""
    latencies = {
        "coordinator_dispatch_latency_s": (
            scheduler.dispatch_latency,
            "Seconds from a group's admission to its first request sent to a server (waits for a server at its "
            "version floor included).",
        ),
        "coordinator_routing_latency_s": (
            scheduler.routing_latency,
            "The same without the wait for a server at the group's version floor: the coordinator's routing time.",
        ),
    }
    for name, (histogram, doc) in latencies.items():
        buckets = [("+Inf" if bound == float("inf") else repr(bound), count) for bound, count in histogram.cumulative()]
        yield HistogramMetricFamily(name, doc, buckets=buckets, sum_value=histogram.sum_s)


async def start_metrics_server(reporter: MetricsReporter, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve Prometheus ``/metrics`` on ``host:port``; returns the runner and the bound port."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(CoordinatorCollector(reporter))

    async def handler(_request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as error:
        await runner.cleanup()
        raise OSError(error.errno, f"coordinator.metrics_port {port} on {host}: {error.strerror}") from error
    return runner, runner.addresses[0][1]


async def reported_eval_versions(client, keys: RedisKeys, count: int = 10000) -> set[int]:
    """Versions an eval round was reported for on this run (the newest ``count`` coordinator reports)."""
    entries = await AsyncMetricsStreamReader(client, keys).newest("coordinator", count)
    reports = (entry.report for entry in entries if entry.report is not None)
    return {int(report.values["eval/version"]) for report in reports if "eval/version" in report.values}
