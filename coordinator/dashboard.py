"""Live web dashboard of a run: ``DashboardState`` (the plain core) and a small aiohttp server around it.

``DashboardState`` reads the run's metrics streams (``keys.metrics(role)``) and the fleet hash from Redis
into bounded ring buffers and renders one JSON snapshot. The server serves that snapshot at
``/api/state`` and a static page (``coordinator/dashboard_page/``) that polls it and draws its own charts,
so the dashboard works with no internet access. The coordinator starts it with one call::

    runner, port = await start_dashboard(client, keys, host, port)
    ...
    await runner.cleanup()
"""

from __future__ import annotations

import asyncio
import errno
import logging
import re
import time
from collections import deque
from dataclasses import dataclass
from importlib import resources

import msgspec
import redis.asyncio as aioredis
from aiohttp import web

from channels.retry import UNREACHABLE
from channels.version_board import AsyncVersionBoard
from protos.records import MetricsReport, VersionReport, decode_metrics
from protos.redis_keys import RedisKeys

logger = logging.getLogger(__name__)

ROLES = ("trainer", "coordinator", "rollout")
EVAL_KEY = re.compile(r"^eval/(?P<dataset>.+)/acc$")
# Cumulative count of groups trained at staleness k, if the trainer reports it ("staleness_groups/0": 12.0).
STALENESS_COUNT_KEY = re.compile(r"^staleness_groups/(?P<steps>\d+)$")


@dataclass(frozen=True)
class SeriesRef:
    """One line of a chart: ``values[key]`` of the reports of ``role``."""

    role: str
    key: str
    label: str


@dataclass(frozen=True)
class ChartSpec:
    """A chart of the page; a line whose series no role reports is drawn as "no data"."""

    chart_id: str
    title: str
    unit: str
    lines: tuple[SeriesRef, ...]


CHARTS = (
    ChartSpec(
        "rollout_tokens",
        "Rollout tokens/s",
        "tok/s",
        (
            SeriesRef("coordinator", "tokens_per_s", "fleet (coordinator)"),
            SeriesRef("rollout", "tokens_per_s", "rollout reports"),
        ),
    ),
    ChartSpec(
        "trainer_samples", "Trainer samples/s", "samples/s", (SeriesRef("trainer", "samples_per_s", "samples/s"),)
    ),
    ChartSpec("trainer_tokens", "Trainer tokens/s", "tok/s", (SeriesRef("trainer", "tokens_per_s", "loss tokens/s"),)),
    ChartSpec(
        "queue_depth",
        "Queue depth",
        "groups",
        (
            SeriesRef("trainer", "queue_depth", "at trainer step"),
            SeriesRef("coordinator", "queue_depth", "coordinator"),
        ),
    ),
    ChartSpec(
        "staleness",
        "Staleness",
        "steps",
        (SeriesRef("trainer", "staleness_max", "max"), SeriesRef("trainer", "staleness_mean", "mean")),
    ),
    ChartSpec("reward", "Reward", "", (SeriesRef("trainer", "reward_mean", "trained batch mean"),)),
    ChartSpec("eval_acc", "Eval accuracy", "", ()),  # lines found at run time: eval/<dataset>/acc
    ChartSpec(
        "masked",
        "Masked-sequence ratio",
        "",
        (
            SeriesRef("trainer", "geo_mask_masked_ratio", "geo-mask sequences"),
            SeriesRef("trainer", "icepop_masked_token_ratio", "icepop tokens"),
        ),
    ),
    ChartSpec(
        "abs_dlogp",
        "Mean |\u0394logp| trainer vs rollout",
        "nats",
        (SeriesRef("trainer", "mean_abs_logprob_diff", "mean |\u0394logp|"),),
    ),
    ChartSpec(
        "weight_update",
        "Weight update duration",
        "s",
        (SeriesRef("trainer", "publish_s", "trainer publish"), SeriesRef("rollout", "weight_update_s", "rollout load")),
    ),
    ChartSpec("loss", "Loss", "", (SeriesRef("trainer", "loss", "loss"),)),
)


@dataclass(frozen=True)
class MetricsPoint:
    time_s: float
    step: int
    policy_version: int
    values: dict[str, float]


class DashboardPortTaken(OSError):
    """The dashboard's port is already bound by another process."""


class DashboardState:
    """Ring buffers of every role's recent metrics reports plus the fleet view; renders snapshots.

    Args:
        client: Redis client of the run.
        keys: key names of the run.
        max_points: reports kept per role (the ring-buffer bound).
        min_refresh_s: several viewers polling at once share one Redis read per this interval.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        keys: RedisKeys,
        max_points: int = 600,
        min_refresh_s: float = 0.5,
        roles: tuple[str, ...] = ROLES,
    ):
        self.client = client
        self.keys = keys
        self.board = AsyncVersionBoard(client, keys)
        self.max_points = max_points
        self.min_refresh_s = min_refresh_s
        self.roles = roles
        self.points: dict[str, deque[MetricsPoint]] = {role: deque(maxlen=max_points) for role in roles}
        self.done: dict[str, bool] = dict.fromkeys(roles, False)
        self.servers: dict[str, VersionReport] = {}
        self.trainer_version: int | None = None
        self._cursors: dict[str, str] = {}
        self._last_refresh = float("-inf")
        self._lock = asyncio.Lock()

    # reading Redis -------------------------------------------------------------------------
    async def refresh(self) -> None:
        """Read the reports added since the last refresh, the fleet hash and the trainer's version."""
        for role in self.roles:
            await self._read_role(role)
        self.servers = await self.board.fleet_reports()
        self.trainer_version = await self.board.published_version()
        self._last_refresh = time.monotonic()

    async def refresh_if_due(self) -> None:
        async with self._lock:
            if time.monotonic() - self._last_refresh >= self.min_refresh_s:
                await self.refresh()

    async def _read_role(self, role: str) -> None:
        # Newest-first with a count of max_points: a long backlog (a dashboard opened late in a run)
        # costs one bounded read, and the ring buffer would keep only those points anyway.
        cursor = self._cursors.get(role)
        oldest = "(" + cursor if cursor else "-"  # "(" makes the range exclusive of the cursor
        entries = await self.client.xrevrange(self.keys.metrics(role), max="+", min=oldest, count=self.max_points)
        for entry_id, fields in reversed(entries):
            self._cursors[role] = entry_id.decode()
            if b"d" in fields:  # a RoleDone: the role's end-of-run marker carries no figures
                self.done[role] = True
                continue
            try:
                report = decode_metrics(fields[b"m"])
            except (KeyError, msgspec.DecodeError) as error:
                logger.warning("dashboard: skipping undecodable entry %s of %s: %r", entry_id, role, error)
                continue
            self.ingest(role, report)

    def ingest(self, role: str, report: MetricsReport) -> None:
        """Append one report to the role's ring buffer (the trainer's with derived throughput)."""
        values = dict(report.values)
        if role == "trainer":
            self._derive_trainer_rates(report, values)
        self.points[role].append(MetricsPoint(report.time_s, report.step, report.policy_version, values))

    def _derive_trainer_rates(self, report: MetricsReport, values: dict[str, float]) -> None:
        # Wall-clock throughput between consecutive reports (queue waits included, which is the point),
        # so the first report seen has none.
        buffer = self.points["trainer"]
        previous = buffer[-1] if buffer else None
        if previous is None or report.time_s <= previous.time_s:
            return
        elapsed_s = report.time_s - previous.time_s
        if "samples_per_s" not in values and "samples_trained" in values:
            before = previous.values.get("samples_trained", 0.0)
            values["samples_per_s"] = (values["samples_trained"] - before) / elapsed_s
        if "tokens_per_s" not in values and "num_tokens" in values:
            values["tokens_per_s"] = values["num_tokens"] / elapsed_s

    # rendering -----------------------------------------------------------------------------
    def snapshot(self, now_s: float | None = None) -> dict:
        """Everything the page draws, as plain JSON-ready data; series are oldest first."""
        now_s = time.time() if now_s is None else now_s
        return {
            "run_id": self.keys.run_id,
            "now_s": now_s,
            "trainer_version": self.trainer_version,
            "max_points": self.max_points,
            "roles": {role: self._role_summary(role, now_s) for role in self.roles},
            "charts": [self._render_chart(spec) for spec in CHARTS],
            "staleness_hist": self._staleness_histogram(),
            "servers": [self._server_row(report, now_s) for _, report in sorted(self.servers.items())],
        }

    def series(self, role: str, key: str) -> list[list[float]]:
        """``[[time_s, value], ...]`` of ``key`` over the role's buffer, oldest first."""
        return [[p.time_s, p.values[key]] for p in self.points.get(role, ()) if key in p.values]

    def _render_chart(self, spec: ChartSpec) -> dict:
        refs = self._eval_refs() if spec.chart_id == "eval_acc" else spec.lines
        lines = []
        for ref in refs:
            points = self.series(ref.role, ref.key)
            lines.append(
                {
                    "series": f"{ref.role}/{ref.key}",
                    "label": ref.label,
                    "points": points,
                    "latest": points[-1][1] if points else None,
                }
            )
        return {"id": spec.chart_id, "title": spec.title, "unit": spec.unit, "lines": lines}

    def _eval_refs(self) -> list[SeriesRef]:
        found: dict[tuple[str, str], SeriesRef] = {}
        for role, buffer in self.points.items():
            for point in buffer:
                for key in point.values:
                    match = EVAL_KEY.match(key)
                    if match and (role, key) not in found:
                        found[(role, key)] = SeriesRef(role, key, match["dataset"])
        return sorted(found.values(), key=lambda ref: (ref.label, ref.role))

    def _staleness_histogram(self) -> dict:
        trainer = self.points.get("trainer")
        if not trainer:
            return {"source": "", "bins": []}
        counts = {int(m["steps"]): v for k, v in trainer[-1].values.items() if (m := STALENESS_COUNT_KEY.match(k))}
        source = "groups trained at each staleness (whole run)"
        if not counts:  # the trainer reports no per-group counts: show how often each per-step max occurred
            source = f"steps by their max staleness (last {len(trainer)} steps)"
            for point in trainer:
                if "staleness_max" in point.values:
                    steps = int(point.values["staleness_max"])
                    counts[steps] = counts.get(steps, 0) + 1
        return {"source": source, "bins": [[steps, counts[steps]] for steps in sorted(counts)]}

    def _role_summary(self, role: str, now_s: float) -> dict | None:
        buffer = self.points[role]
        if not buffer:
            return {"num_points": 0, "done": self.done[role]} if self.done[role] else None
        last = buffer[-1]
        return {
            "num_points": len(buffer),
            "step": last.step,
            "policy_version": last.policy_version,
            "age_s": now_s - last.time_s,
            "done": self.done[role],
        }

    def _server_row(self, report: VersionReport, now_s: float) -> dict:
        lag = None if self.trainer_version is None else self.trainer_version - report.policy_version
        return {
            "server_id": report.server_id,
            "address": report.address,
            "policy_version": report.policy_version,
            "lag_versions": lag,
            "status": report.status.name,
            "message": report.message,
            "age_s": now_s - report.time_s,
        }


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


async def _state_handler(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    try:
        await state.refresh_if_due()
    except UNREACHABLE as error:
        # The page keeps its last data and shows this; the coordinator itself is not disturbed.
        logger.warning("dashboard: Redis read failed: %s", error)
        body = msgspec.json.encode({"error": f"Redis unreachable: {error}"})
        return web.Response(body=body, status=503, content_type="application/json")
    # msgspec writes NaN/inf as null, which JSON.parse accepts and the charts skip.
    return web.Response(
        body=msgspec.json.encode(state.snapshot()),
        content_type="application/json",
        headers={"Cache-Control": "no-store"},
    )


async def start_dashboard(
    client: aioredis.Redis, keys: RedisKeys, host: str = "127.0.0.1", port: int = 0, max_points: int = 600
) -> tuple[web.AppRunner, int]:
    """Serve the dashboard on ``host:port`` (0 picks a free port); returns the runner and the bound port.

    Stop it with ``await runner.cleanup()``. Raises ``DashboardPortTaken`` if the port is in use.
    """
    runner = web.AppRunner(build_app(DashboardState(client, keys, max_points)), access_log=None)
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
