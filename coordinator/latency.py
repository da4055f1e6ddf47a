"""LatencyHistogram: seconds in Prometheus' bucket layout, cheap enough to observe at every dispatch.

The scheduler keeps two (``Scheduler.dispatch_latency`` and ``Scheduler.routing_latency``); ``metrics.py`` exports
them as ``coordinator_dispatch_latency_s`` and ``coordinator_routing_latency_s``. ``quantile`` reads a quantile off
cumulative bucket counts the way PromQL's ``histogram_quantile`` does (linear inside the bucket), so a reader of
two scrapes can take the quantiles of the window between them (``benchmarks/fleet_scale.py``).
"""

from __future__ import annotations

import bisect
import math

# Fine below 10 ms, where routing should sit, then coarse up to the waits for a server at a new version.
BOUNDS_S = (
    0.0001,
    0.0002,
    0.0003,
    0.0005,
    0.00075,
    0.001,
    0.0015,
    0.002,
    0.003,
    0.004,
    0.005,
    0.006,
    0.008,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
)


class LatencyHistogram:
    """Counts of observations per bucket (``value <= bound``, the last bucket is +Inf), their sum and number."""

    def __init__(self, bounds_s: tuple[float, ...] = BOUNDS_S):
        if list(bounds_s) != sorted(set(bounds_s)) or not bounds_s:
            raise ValueError(f"histogram bounds must be distinct and increasing, got {bounds_s}")
        self.bounds_s = tuple(bounds_s)
        self.counts = [0] * (len(bounds_s) + 1)
        self.sum_s = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds_s, seconds)] += 1
        self.sum_s += seconds
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations <= it) per bucket, ending with (+inf, count): Prometheus' ``_bucket`` series."""
        pairs, total = [], 0
        for bound, count in zip((*self.bounds_s, math.inf), self.counts, strict=True):
            total += count
            pairs.append((bound, total))
        return pairs


def quantile(q: float, cumulative: list[tuple[float, int]]) -> float:
    """The ``q`` quantile of cumulative (bound, count) buckets, interpolated linearly inside its bucket.

    NaN without observations; a quantile in the +Inf bucket is the highest finite bound (as in PromQL).
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile q must be in [0, 1], got {q}")
    total = cumulative[-1][1] if cumulative else 0
    if total == 0:
        return math.nan
    rank = q * total
    lower_bound, lower_count = 0.0, 0
    for bound, count in cumulative:
        if count >= rank and count > lower_count:
            if math.isinf(bound):
                return lower_bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound
