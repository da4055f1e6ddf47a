"""The dashboard's memory of a whole run: every report of one source, in bounded space, and its downsampling.

``SeriesHistory`` holds the reports of one source (a role, or one rollout server) as time-ordered slots. A slot
starts as one report; per key it keeps the lowest and the highest value it has seen (equal for one report). When the
slots reach ``capacity``, the older half is merged pairwise (min of the lows, max of the highs, the time span of
both): recent reports stay exact, older ones get coarser, a run of any length fits in ``capacity`` slots, and no
spike is ever averaged away.

``window(key, from_s, to_s, max_points)`` is what a chart draws: the slots inside the window, grouped into at most
``max_points // 2`` buckets of equal time width, each drawn as its low and its high (min/max decimation: a bucket's
spike survives the downsampling, as in the full-resolution series). Fewer slots than that are drawn one by one.
"""

from __future__ import annotations

import bisect
import math
from array import array
from dataclasses import dataclass, field

NAN = float("nan")
DEFAULT_CAPACITY = 4096
MAX_CHART_POINTS = 500


def _lower(a: float, b: float) -> float:
    return b if math.isnan(a) else a if math.isnan(b) else min(a, b)


def _higher(a: float, b: float) -> float:
    return b if math.isnan(a) else a if math.isnan(b) else max(a, b)


@dataclass
class Column:
    """One key's lows and highs, a value per slot (NaN: no report of the slot had the key)."""

    lo: array = field(default_factory=lambda: array("d"))
    hi: array = field(default_factory=lambda: array("d"))


class SeriesHistory:
    """The reports of one source over the whole run, in at most ``capacity`` slots.

    Args:
        capacity: slots kept (an even number; the older half is merged when they are full).
        keys: which report values to keep a column for (a callable: key -> bool); the others are kept only in
            ``latest`` (the server table and the legends show the newest report whole).
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY, keys=lambda key: True):
        if capacity < 4 or capacity % 2:
            raise ValueError(f"capacity={capacity} must be an even number >= 4")
        self.capacity = capacity
        self.wants = keys
        self.starts = array("d")  # time of each slot's first report
        self.ends = array("d")  # time of its last
        self.columns: dict[str, Column] = {}
        self.latest: dict[str, float] = {}  # the newest report's values, all of them
        self.latest_time_s = NAN
        self.num_reports = 0

    def __len__(self) -> int:
        return len(self.starts)

    def append(self, time_s: float, values: dict[str, float]) -> None:
        """Add one report (reports arrive in time order; one from the past is placed at the newest slot's time)."""
        if self.starts and time_s < self.ends[-1]:
            time_s = self.ends[-1]
        if len(self.starts) >= self.capacity:
            self._merge_older_half()
        self.starts.append(time_s)
        self.ends.append(time_s)
        for key, column in self.columns.items():
            value = values.get(key, NAN)
            column.lo.append(value)
            column.hi.append(value)
        for key, value in values.items():
            if key not in self.columns and self.wants(key):
                column = self.columns[key] = Column(array("d", [NAN] * (len(self.starts) - 1)))
                column.hi = array("d", column.lo)
                column.lo.append(value)
                column.hi.append(value)
        self.latest, self.latest_time_s = dict(values), time_s
        self.num_reports += 1

    def _merge_older_half(self) -> None:
        half = self.capacity // 2
        pairs = range(0, half, 2)
        self.starts[:half] = array("d", (self.starts[i] for i in pairs))
        self.ends[:half] = array("d", (self.ends[i + 1] for i in pairs))
        for column in self.columns.values():
            lo, hi = column.lo, column.hi
            lo[:half] = array("d", (_lower(lo[i], lo[i + 1]) for i in pairs))
            hi[:half] = array("d", (_higher(hi[i], hi[i + 1]) for i in pairs))

    @property
    def first_time_s(self) -> float:
        return self.starts[0] if self.starts else NAN

    def window(self, key: str, from_s: float, to_s: float, max_points: int = MAX_CHART_POINTS) -> list[list[float]]:
        """``[[time_s, value], ...]`` of ``key`` between ``from_s`` and ``to_s``, at most ``max_points``, oldest first."""
        column = self.columns.get(key)
        if column is None:
            return []
        first = bisect.bisect_left(self.ends, from_s)
        last = bisect.bisect_right(self.starts, to_s)
        slots = [i for i in range(first, last) if not math.isnan(column.lo[i])]
        num_buckets = max(1, max_points // 2)
        if len(slots) <= num_buckets:
            spans = [(self.starts[i], self.ends[i], column.lo[i], column.hi[i]) for i in slots]
        else:
            spans = _bucket(slots, self.starts, self.ends, column, from_s, to_s, num_buckets)
        return _draw(spans)


def _bucket(slots, starts, ends, column: Column, from_s: float, to_s: float, num_buckets: int) -> list[tuple]:
    """Group ``slots`` into ``num_buckets`` buckets of equal time width: (start, end, low, high) of each non-empty one."""
    from_s, to_s = max(from_s, starts[slots[0]]), min(to_s, ends[slots[-1]])
    width = max(1e-9, (to_s - from_s) / num_buckets)
    buckets: dict[int, list[float]] = {}
    for i in slots:
        index = min(num_buckets - 1, max(0, int((starts[i] - from_s) / width)))
        bucket = buckets.get(index)
        if bucket is None:
            buckets[index] = [starts[i], ends[i], column.lo[i], column.hi[i]]
        else:
            bucket[1] = ends[i]
            bucket[2] = min(bucket[2], column.lo[i])
            bucket[3] = max(bucket[3], column.hi[i])
    return [tuple(buckets[index]) for index in sorted(buckets)]


def _draw(spans: list[tuple]) -> list[list[float]]:
    """One point per exact span; a span with a low and a high becomes two points over its time range, the one nearer
    the previous point first, so the line does not zig-zag more than the data does."""
    points: list[list[float]] = []
    for start, end, lo, hi in spans:
        if lo == hi:
            points.append([end, lo])
            continue
        near, far = (lo, hi) if not points or abs(points[-1][1] - lo) <= abs(points[-1][1] - hi) else (hi, lo)
        points.append([start, near])
        points.append([end, far])
    return points
