"""Live web dashboard of a run: ``DashboardState`` (the plain core) and a small aiohttp server around it.

``DashboardState`` reads the run's metrics streams (channels/metrics_stream.py: the trainer's, the coordinator's and
every rollout server's reports) from their start, into a ``SeriesHistory`` per source that covers the whole run in
bounded memory (coordinator/dashboard_history.py), and the fleet hash. It renders one JSON snapshot for a time window
(the whole run unless asked for less), every series downsampled to at most ``max_chart_points`` points. The server
serves that snapshot at ``/api/state?from=<unix s>&to=<unix s>`` and a static page (``coordinator/dashboard_page/``)
that polls it, draws its own charts and has a range selector, so the dashboard works with no internet access. The
coordinator starts it with one call::

    runner, port = await start_dashboard(client, keys, host, port)
    ...
    await runner.cleanup()
"""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import time
from importlib import resources

import msgspec
import redis.asyncio as aioredis
from aiohttp import web

from channels.metrics_stream import AsyncMetricsStreamReader
from channels.retry import UNREACHABLE
from channels.version_board import AsyncVersionBoard
from coordinator.dashboard_charts import CHARTS, Histories, charted_keys, render_chart, staleness_histogram
from coordinator.dashboard_history import DEFAULT_CAPACITY, MAX_CHART_POINTS, SeriesHistory
from protos.records import MetricsReport, VersionReport
from protos.redis_keys import RedisKeys

logger = logging.getLogger(__name__)

ROLES = ("trainer", "coordinator", "rollout")
PAGE_SIZE = 5000  # entries per Redis read; a dashboard opened late catches up a few pages per refresh
MAX_PAGES_PER_REFRESH = 10


class DashboardPortTaken(OSError):
    """The dashboard's port is already bound by another process."""


class DashboardState:
    """The whole run's reports per source plus the fleet view; renders snapshots of a time window.

    Args:
        client: Redis client of the run.
        keys: key names of the run.
        capacity: slots each source's history keeps (dashboard_history.SeriesHistory).
        max_chart_points: points per series in a snapshot, at most.
        min_refresh_s: several viewers polling at once share one Redis read per this interval.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        keys: RedisKeys,
        capacity: int = DEFAULT_CAPACITY,
        max_chart_points: int = MAX_CHART_POINTS,
        min_refresh_s: float = 0.5,
        roles: tuple[str, ...] = ROLES,
    ):
        self.keys = keys
        self.reader = AsyncMetricsStreamReader(client, keys)
        self.board = AsyncVersionBoard(client, keys)
        self.capacity = capacity
        self.max_chart_points = max_chart_points
        self.min_refresh_s = min_refresh_s
        self.roles = roles
        self.histories: Histories = {}
        self.done: dict[str, bool] = dict.fromkeys(roles, False)
        self.servers: dict[str, VersionReport] = {}
        self.trainer_version: int | None = None
        self._cursors: dict[str, str] = dict.fromkeys(roles, "0")
        self._last_refresh = float("-inf")
        self._lock = asyncio.Lock()

    # reading Redis -------------------------------------------------------------------------
    async def refresh(self) -> None:
        """Read the reports added since the last refresh, the fleet hash and the trainer's version."""
        for role in self.roles:
            for _ in range(MAX_PAGES_PER_REFRESH):
                entries, self._cursors[role] = await self.reader.page(role, self._cursors[role], PAGE_SIZE)
                for entry in entries:
                    if entry.done is not None:  # the role's end-of-run marker carries no figures
                        self.done[role] = True
                    else:
                        self.ingest(entry.report)
                if len(entries) < PAGE_SIZE:
                    break
        self.servers = await self.board.fleet_reports()
        self.trainer_version = await self.board.published_version()
        self._last_refresh = time.monotonic()

    async def refresh_if_due(self) -> None:
        async with self._lock:
            if time.monotonic() - self._last_refresh >= self.min_refresh_s:
                await self.refresh()

    def ingest(self, report: MetricsReport) -> None:
        """Add one report to its source's history (the trainer's with derived throughput)."""
        key = (report.role, report.source)
        history = self.histories.get(key)
        if history is None:
            history = self.histories[key] = SeriesHistory(self.capacity, charted_keys(report.role))
        values = dict(report.values)
        if report.role == "trainer":
            _derive_trainer_rates(history, report.time_s, values)
        values.setdefault("step", float(report.step))
        values.setdefault("policy_version", float(report.policy_version))
        history.append(report.time_s, values)

    # rendering -----------------------------------------------------------------------------
    def run_span(self) -> tuple[float, float]:
        """(first report time, newest report time) over every source; NaNs before the first report."""
        firsts = [h.first_time_s for h in self.histories.values() if len(h)]
        lasts = [h.latest_time_s for h in self.histories.values() if len(h)]
        return (min(firsts), max(lasts)) if firsts else (math.nan, math.nan)

    def snapshot(self, now_s: float | None = None, from_s: float | None = None, to_s: float | None = None) -> dict:
        """Everything the page draws over [from_s, to_s] (default: the whole run), as JSON-ready data."""
        now_s = time.time() if now_s is None else now_s
        run_from, run_to = self.run_span()
        window_from = run_from if from_s is None else from_s
        window_to = max(now_s, run_to if not math.isnan(run_to) else now_s) if to_s is None else to_s
        charts = [render_chart(spec, self.histories, window_from, window_to, self.max_chart_points) for spec in CHARTS]
        return {
            "run_id": self.keys.run_id,
            "now_s": now_s,
            "trainer_version": self.trainer_version,
            "max_chart_points": self.max_chart_points,
            "window": {"from_s": window_from, "to_s": window_to, "run_from_s": run_from, "run_to_s": run_to},
            "roles": {role: self._role_summary(role, now_s) for role in self.roles},
            "charts": charts,
            "staleness_hist": staleness_histogram(self.histories.get(("trainer", ""))),
            "servers": [self._server_row(report, now_s) for _, report in sorted(self.servers.items())],
        }

    def _role_summary(self, role: str, now_s: float) -> dict | None:
        histories = [h for (r, _), h in self.histories.items() if r == role and h.num_reports]
        if not histories:
            return {"num_points": 0, "done": self.done[role]} if self.done[role] else None
        newest = max(histories, key=lambda h: h.latest_time_s)
        return {
            "num_points": sum(h.num_reports for h in histories),
            "num_sources": len(histories),
            "step": int(newest.latest["step"]),
            "policy_version": int(newest.latest["policy_version"]),
            "age_s": now_s - newest.latest_time_s,
            "done": self.done[role],
        }

    def _server_row(self, report: VersionReport, now_s: float) -> dict:
        lag = None if self.trainer_version is None else self.trainer_version - report.policy_version
        row = {
            "server_id": report.server_id,
            "address": report.address,
            "policy_version": report.policy_version,
            "lag_versions": lag,
            "status": report.status.name,
            "message": report.message,
            "age_s": now_s - report.time_s,
            "update_s": report.update_s,
            "paused_s": report.paused_s,
        }
        history = self.histories.get(("rollout", report.server_id))
        if history is not None and history.num_reports:  # the server's own periodic figures
            row["live"] = {"age_s": now_s - history.latest_time_s, **history.latest}
        return row


def _derive_trainer_rates(history: SeriesHistory, time_s: float, values: dict[str, float]) -> None:
    # Wall-clock throughput between consecutive reports (queue waits included, which is the point),
    # so the first report seen has none.
    if not history.num_reports or time_s <= history.latest_time_s:
        return
    elapsed_s, previous = time_s - history.latest_time_s, history.latest
    if "samples_per_s" not in values and "samples_trained" in values:
        values["samples_per_s"] = (values["samples_trained"] - previous.get("samples_trained", 0.0)) / elapsed_s
    if "tokens_per_s" not in values and "num_tokens" in values:
        values["tokens_per_s"] = values["num_tokens"] / elapsed_s


# HTTP adapter ------------------------------------------------------------------------------------
STATE_KEY: web.AppKey[DashboardState] = web.AppKey("dashboard_state", DashboardState)
PAGE_FILES = {"/": ("index.html", "text/html"), "/dashboard.js": ("dashboard.js", "application/javascript")}


def build_app(state: DashboardState) -> web.Application:
    """The page, its script and ``/api/state``; the page files are read once, here."""
    page_dir = resources.files("coordinator").joinpath("dashboard_page")
    app = web.Application()
    app[STATE_KEY] = state
    for path, (name, content_type) in PAGE_FILES.items():
        body = page_dir.joinpath(name).read_bytes()
        app.router.add_get(path, _static_handler(body, content_type))
    app.router.add_get("/api/state", _state_handler)
    return app


def _static_handler(body: bytes, content_type: str):
    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type=content_type, charset="utf-8")

    return handler


def _window(request: web.Request) -> tuple[float | None, float | None]:
    """The ``from``/``to`` query parameters (unix seconds; absent: the run's start, now)."""
    bounds = []
    for name in ("from", "to"):
        raw = request.query.get(name, "")
        try:
            value = float(raw) if raw else None
        except ValueError:
            raise web.HTTPBadRequest(text=f"query parameter {name}={raw!r} is not a number of unix seconds") from None
        if value is not None and not math.isfinite(value):
            raise web.HTTPBadRequest(text=f"query parameter {name}={raw!r} is not finite")
        bounds.append(value)
    if None not in bounds and bounds[0] >= bounds[1]:
        raise web.HTTPBadRequest(text=f"query parameters from={bounds[0]} and to={bounds[1]}: from must be before to")
    return bounds[0], bounds[1]


async def _state_handler(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    from_s, to_s = _window(request)
    try:
        await state.refresh_if_due()
    except UNREACHABLE as error:
        # The page keeps its last data and shows this; the coordinator itself is not disturbed.
        logger.warning("dashboard: Redis read failed: %s", error)
        body = msgspec.json.encode({"error": f"Redis unreachable: {error}"})
        return web.Response(body=body, status=503, content_type="application/json")
    # msgspec writes NaN/inf as null, which JSON.parse accepts and the charts skip.
    return web.Response(
        body=msgspec.json.encode(state.snapshot(from_s=from_s, to_s=to_s)),
        content_type="application/json",
        headers={"Cache-Control": "no-store"},
    )


async def start_dashboard(
    client: aioredis.Redis, keys: RedisKeys, host: str = "127.0.0.1", port: int = 0, capacity: int = DEFAULT_CAPACITY
) -> tuple[web.AppRunner, int]:
    """Serve the dashboard on ``host:port`` (0 picks a free port); returns the runner and the bound port.

    Stop it with ``await runner.cleanup()``. Raises ``DashboardPortTaken`` if the port is in use.
    """
    runner = web.AppRunner(build_app(DashboardState(client, keys, capacity)), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as error:
        await runner.cleanup()
        if error.errno == errno.EADDRINUSE:
            raise DashboardPortTaken(
                errno.EADDRINUSE,
                f"dashboard port {port} on {host} is already in use; choose another port or 0 for a free one",
            ) from error
        raise
    bound_port = runner.addresses[0][1]
    logger.info("dashboard of run %s on http://%s:%d/", keys.run_id, host, bound_port)
    return runner, bound_port
