"""A rollout server's figures: Prometheus metrics named ``rollout_<thing>_<unit>`` (``rollout/`` in docs; the Grafana
dashboard and deploy/prometheus/alerts.yml read them), and ``RolloutReporter``, which writes the same figures every
``REPORT_INTERVAL_S`` onto the run's ``rollout`` metrics stream (channels/metrics_stream.py) for the dashboard.

Tokens are counted as the engine generates them (every engine step: vLLM's iteration stats; the synthetic engine's
chunks), not when a response is sent: with a stream interval as long as a response, counting at the send made the
rate jump between 0 and several times its mean. The rate an operator reads is one figure, ``current_rate()``: the
tokens of the last ``RATE_WINDOW_S`` seconds. The server's metrics reports, its heartbeat (which the coordinator
sums into the fleet's rate: the console line, the dashboard's fleet series, ``fleetrl status``) and the
``rollout_tokens_per_s`` gauge all read it.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

from prometheus_client import Counter, Gauge, Histogram

from channels.metrics_stream import AsyncMetricsStreamWriter
from protos.records import ROLLOUT_RATE_WINDOW_S, MetricsReport

REPORT_INTERVAL_S = 2.0
# Up to 10 minutes: a large model's update takes longer than the default buckets' top (10 s), and the alert on slow
# updates needs buckets above its threshold.
DURATION_BUCKETS_S = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
REJECT_REASONS = ("invalid", "busy", "draining")
RATE_WINDOW_S = ROLLOUT_RATE_WINDOW_S  # every displayed rollout tokens/s is the mean over this many seconds

TOKENS = Counter("rollout_generated_tokens", "Tokens generated, counted per engine step (rate() gives tokens/s)")
TOKENS_PER_S = Gauge("rollout_tokens_per_s", f"Tokens generated per second over the last {RATE_WINDOW_S:g} s")
RUNNING = Gauge("rollout_requests_running", "Generate calls in flight")
WAITING = Gauge("rollout_requests_waiting", "Requests queued in the engine scheduler (last engine step)")
KV_CACHE_USAGE = Gauge("rollout_kv_cache_usage_ratio", "Fraction of the KV cache in use (last engine step)")
REJECTED = Counter("rollout_requests_rejected", "Generate calls rejected", ["reason"])
TTFT = Histogram("rollout_time_to_first_token_s", "Seconds from request to first token")
POLICY_VERSION = Gauge("rollout_policy_version", "Policy version in force")
UPDATE_SECONDS = Histogram(
    "rollout_weight_update_s", "Seconds to receive and commit a version", buckets=DURATION_BUCKETS_S
)
UPDATE_PAUSE_SECONDS = Histogram(
    "rollout_weight_update_pause_s", "Seconds generation was paused for a commit", buckets=DURATION_BUCKETS_S
)
UPDATE_FAILURES = Counter("rollout_weight_update_failures", "Versions not put in force (the server stayed on its own)")
for _reason in REJECT_REASONS:  # every series exists from the start: rate() and alerts see 0, not "no data"
    REJECTED.labels(_reason)

_tokens_generated = 0  # the same count as TOKENS, readable without prometheus_client internals


class WindowedRate:
    """The rate of a growing count over the last ``window_s`` seconds, from the samples taken at each read.

    The oldest sample kept is the newest one at least ``window_s`` old, so the rate spans ``window_s`` plus at most
    one gap between reads (reads come every second or two: the heartbeat, the reports, scrapes); before the first
    ``window_s`` it spans what there is.
    """

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._samples: deque[tuple[float, int]] = deque()

    def update(self, now_s: float, total: int) -> float:
        samples = self._samples
        samples.append((now_s, total))
        while len(samples) > 1 and samples[1][0] <= now_s - self.window_s:
            samples.popleft()
        first_s, first_total = samples[0]
        return (total - first_total) / (now_s - first_s) if now_s > first_s else 0.0


_rate = WindowedRate(RATE_WINDOW_S)


def count_generated(num_tokens: int) -> None:
    """Tokens the engine generated (called per engine step by the engine, not per response)."""
    global _tokens_generated
    _tokens_generated += num_tokens
    TOKENS.inc(num_tokens)


def tokens_generated_total() -> int:
    return _tokens_generated


def current_rate() -> float:
    """Tokens generated per second over the last ``RATE_WINDOW_S`` (the one rate every display shows)."""
    return _rate.update(time.monotonic(), _tokens_generated)


TOKENS_PER_S.set_function(current_rate)


def track_engine(engine) -> None:
    """Read the engine's scheduler figures and version at scrape time instead of pushing them."""
    WAITING.set_function(lambda: engine.load()[1])
    KV_CACHE_USAGE.set_function(lambda: engine.load()[2])
    POLICY_VERSION.set_function(lambda: engine.policy_version)


class RolloutReporter:
    """One ``MetricsReport("rollout", source=<server id>)`` every interval: throughput since the last report, load,
    KV cache, the version in force and what the last weight update cost. Its ``step`` counts the server's reports.

    Args:
        engine: the server's RolloutEngine (load, version, server id, last load time).
        servicer: the gRPC servicer (Generate calls in flight).
        follower: the WeightFollower (durations of the last update), or None.
        stream: the run's metrics stream writer.
    """

    def __init__(self, engine, servicer, follower, stream: AsyncMetricsStreamWriter):
        self.engine = engine
        self.servicer = servicer
        self.follower = follower
        self.stream = stream
        self.num_reports = 0

    def values(self) -> dict[str, float]:
        running, waiting, kv_cache = self.engine.load()
        values = {
            "tokens_per_s": current_rate(),
            "tokens_generated": float(_tokens_generated),
            "generate_calls": float(self.servicer.inflight),
            "requests_running": float(running),
            "requests_waiting": float(waiting),
            "kv_cache_usage": float(kv_cache),
            "policy_version": float(self.engine.policy_version),
        }
        follower = self.follower
        if follower is not None and follower.last_update_s:  # none before the first update
            values.update(
                weight_update_s=follower.last_update_s,
                weight_receive_s=follower.last_receive_s,
                weight_load_s=self.engine.last_load_s,
                weight_paused_s=follower.last_paused_s,
            )
        return values

    async def report(self) -> bool:
        """One periodic report; while Redis is unreachable it is skipped (logged): the next one is the retry."""
        values = self.values()
        self.num_reports += 1
        report = MetricsReport(
            "rollout", self.num_reports, self.engine.policy_version, time.time(), values, self.engine.server_id
        )
        return await self.stream.post(report)

    async def run(self, stop: asyncio.Event, interval_s: float = REPORT_INTERVAL_S) -> None:
        """Report every ``interval_s`` until ``stop``, and once more then (the final figures)."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=interval_s)
            except TimeoutError:
                pass
            await self.report()


def start_reporting(servicer, follower, stop: asyncio.Event) -> list[asyncio.Task]:
    """The reporter's task on the follower's Redis (the run's); none without one (no ``redis_url``)."""
    if follower is None:
        return []
    reporter = RolloutReporter(
        servicer.engine, servicer, follower, AsyncMetricsStreamWriter(follower.client, follower.keys)
    )
    return [asyncio.create_task(reporter.run(stop), name="metrics-reporter")]
