"""The run's metrics streams (``RedisKeys.metrics(role)``): encoded ``MetricsReport`` records (field ``m``), ended
by a ``RoleDone`` (field ``d``) when the role finishes its run.

Writers: the trainer's rank 0 (one report per step, then its RoleDone), the coordinator (one a second, and one per
eval round) and every rollout server (one every few seconds, ``MetricsReport.source`` = its server id; all servers
share the ``rollout`` stream). Readers: the dashboard (the whole run, page by page), the demo launcher (following the
trainer and the coordinator) and the coordinator's eval bookkeeping (its newest reports).

Outages (channels/retry.py): a periodic report (``timeout_s=0``) is tried once and, while Redis is unreachable,
logged and skipped: the next period is the retry. The trainer's step reports and the RoleDone are retried for a
while, then dropped with an error log: a lost report costs a dashboard point, an exit costs a model reload. XADD is
not idempotent, so a report whose reply was lost can land twice; readers keep the last one of a step. Reads propagate
``UNREACHABLE`` to the caller's loop, which decides.

Each stream keeps about ``MAX_ENTRIES`` entries (XADD MAXLEN ~): for a report a second, more than a day.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import msgspec
import redis
import redis.asyncio as aioredis

from channels.retry import UNREACHABLE, retry_async, retry_sync
from protos.records import MetricsReport, RoleDone, decode_done, decode_metrics, encode
from protos.redis_keys import RedisKeys, as_text

logger = logging.getLogger(__name__)

MAX_ENTRIES = 100000
REPORT_FIELD = b"m"
DONE_FIELD = b"d"


@dataclass(frozen=True)
class MetricsEntry:
    """One entry of a role's metrics stream: a report, or the role's end-of-run marker."""

    role: str
    entry_id: str
    report: MetricsReport | None = None
    done: RoleDone | None = None


def decode_entry(role: str, entry_id: bytes | str, fields: dict) -> MetricsEntry | None:
    """The entry's record; None (with a warning) for a payload no reader can use: not fatal to any reader."""
    entry_id = as_text(entry_id)
    try:
        if DONE_FIELD in fields:
            return MetricsEntry(role, entry_id, done=decode_done(fields[DONE_FIELD]))
        return MetricsEntry(role, entry_id, report=decode_metrics(fields[REPORT_FIELD]))
    except (KeyError, msgspec.DecodeError, msgspec.ValidationError) as error:
        logger.warning("skipping undecodable entry %s of the %s metrics stream: %r", entry_id, role, error)
        return None


def _decode_all(role: str, entries: list) -> list[MetricsEntry]:
    decoded = (decode_entry(role, entry_id, fields) for entry_id, fields in entries)
    return [entry for entry in decoded if entry is not None]


def _after(cursor: str) -> str:
    return "(" + cursor if cursor and cursor != "0" else "-"  # "(" excludes the cursor itself


class MetricsStreamWriter:
    """Appends a role's reports and its RoleDone over a sync client (the trainer's rank 0)."""

    def __init__(self, client: redis.Redis, keys: RedisKeys, max_entries: int = MAX_ENTRIES):
        self.client = client
        self.keys = keys
        self.max_entries = max_entries

    def _xadd(self, role: str, field: bytes, payload: bytes) -> None:
        self.client.xadd(self.keys.metrics(role), {field: payload}, maxlen=self.max_entries, approximate=True)

    def post(self, report: MetricsReport, timeout_s: float = 0.0) -> bool:
        """Append ``report`` to its role's stream, retried for ``timeout_s`` while Redis is unreachable (0: tried
        once, the periodic rule); returns False when it was dropped (logged)."""
        what = f"{report.role} metrics report of step {report.step}"
        payload = encode(report)
        try:
            retry_sync(lambda: self._xadd(report.role, REPORT_FIELD, payload), what, timeout_s)
        except UNREACHABLE as error:
            _log_dropped(what, timeout_s, error)
            return False
        return True

    def post_done(self, done: RoleDone, timeout_s: float = 30.0) -> bool:
        """Append the role's end-of-run marker, retried for ``timeout_s``; returns False when it was dropped."""
        what = f"end-of-run marker of the {done.role}"
        try:
            retry_sync(lambda: self._xadd(done.role, DONE_FIELD, encode(done)), what, timeout_s)
        except UNREACHABLE as error:
            _log_dropped(what, timeout_s, error)
            return False
        return True


class AsyncMetricsStreamWriter:
    """``MetricsStreamWriter`` over an asyncio client (the coordinator, the rollout servers)."""

    def __init__(self, client: aioredis.Redis, keys: RedisKeys, max_entries: int = MAX_ENTRIES):
        self.client = client
        self.keys = keys
        self.max_entries = max_entries

    async def post(self, report: MetricsReport, timeout_s: float = 0.0) -> bool:
        """``MetricsStreamWriter.post``: returns False when the report was dropped (logged)."""
        what = f"{report.role} metrics report of step {report.step}"
        stream, payload = self.keys.metrics(report.role), encode(report)

        async def xadd() -> None:
            await self.client.xadd(stream, {REPORT_FIELD: payload}, maxlen=self.max_entries, approximate=True)

        try:
            await retry_async(xadd, what, timeout_s)
        except UNREACHABLE as error:
            _log_dropped(what, timeout_s, error)
            return False
        return True


def _log_dropped(what: str, timeout_s: float, error: BaseException) -> None:
    if timeout_s > 0:
        logger.error("%s dropped, Redis unreachable for %gs: %s", what, timeout_s, error)
    else:  # periodic: the next period is the retry
        logger.warning("%s skipped, Redis unreachable: %s", what, error)


class MetricsStreamReader:
    """Reads the metrics streams over a sync client (the demo launcher)."""

    def __init__(self, client: redis.Redis, keys: RedisKeys):
        self.client = client
        self.keys = keys

    def follow(self, cursors: dict[str, str], block_s: float) -> list[MetricsEntry]:
        """Entries after ``cursors[role]`` ("0": from the start) of each role, oldest first per role, waiting up to
        ``block_s`` for the first; the cursors move past what is returned (undecodable entries included)."""
        streams = {self.keys.metrics(role): role for role in cursors}
        request = {stream: cursors[role] for stream, role in streams.items()}
        reply = self.client.xread(request, block=max(1, int(block_s * 1000))) or []
        entries = []
        for stream, items in reply:
            role = streams[as_text(stream)]
            if items:
                cursors[role] = as_text(items[-1][0])
            entries += _decode_all(role, items)
        return entries

    def after(self, role: str, cursor: str) -> list[MetricsEntry]:
        """Every entry of ``role`` after ``cursor`` ("0": all), oldest first."""
        return _decode_all(role, self.client.xrange(self.keys.metrics(role), min=_after(cursor)))


class AsyncMetricsStreamReader:
    """Reads the metrics streams over an asyncio client (the dashboard, the coordinator)."""

    def __init__(self, client: aioredis.Redis, keys: RedisKeys):
        self.client = client
        self.keys = keys

    async def page(self, role: str, cursor: str, count: int) -> tuple[list[MetricsEntry], str]:
        """Up to ``count`` entries of ``role`` after ``cursor`` ("0": from the start), oldest first, and the cursor
        after them (the last id read, undecodable entries included; ``cursor`` when there was none)."""
        items = await self.client.xrange(self.keys.metrics(role), min=_after(cursor), count=count)
        return _decode_all(role, items), as_text(items[-1][0]) if items else cursor

    async def newest(self, role: str, count: int) -> list[MetricsEntry]:
        """The newest ``count`` entries of ``role``, oldest first."""
        items = await self.client.xrevrange(self.keys.metrics(role), count=count)
        return _decode_all(role, list(reversed(items)))
