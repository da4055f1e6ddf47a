"""Tests for coordinator.dashboard: the /api/state snapshot over real Redis, and the page in headless Chromium."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import struct
import time
import zlib
from contextlib import asynccontextmanager
from html.parser import HTMLParser
from pathlib import Path

import aiohttp
import msgspec
import pytest
import redis
import redis.asyncio as aioredis

from channels.version_board import AsyncVersionBoard
from coordinator.dashboard import DashboardPortTaken, start_dashboard
from protos.records import MetricsReport, ReportStatus, RoleDone, VersionReport, encode
from protos.redis_keys import RedisKeys

pytestmark = pytest.mark.integration

KEYS = RedisKeys("dash-test")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def write_metrics(client: redis.Redis, role: str, step: int, time_s: float, values: dict[str, float]) -> None:
    """Append a report exactly as the roles do (trainer_service/__main__.py, coordinator/__main__.py)."""
    report = MetricsReport(role, step, step, time_s, values)
    client.xadd(KEYS.metrics(role), {"m": encode(report)}, maxlen=100000, approximate=True)


def trainer_values(step: int) -> dict[str, float]:
    return {
        "reward_mean": 0.5 + 0.05 * step,
        "staleness_max": float(step % 2),
        "staleness_mean": 0.5,
        "loss": 1.0 / step,
        "queue_depth": float(step),
        "samples_trained": 32.0 * step,
        "num_tokens": 640.0,
        "step_s": 2.0,
        "publish_s": 0.25,
        "geo_mask_masked_ratio": 0.125,
        "mean_abs_logprob_diff": 0.02,
        "eval/gsm8k/acc": 0.4 + 0.01 * step,
    }


async def write_run(redis_url: str, num_steps: int = 5, start_s: float | None = None) -> float:
    """A small run: trainer steps 1..num_steps 2 s apart, coordinator reports, two servers, version."""
    start_s = time.time() - 2 * num_steps if start_s is None else start_s
    sync = redis.Redis.from_url(redis_url)
    for step in range(1, num_steps + 1):
        write_metrics(sync, "trainer", step, start_s + 2 * step, trainer_values(step))
        write_metrics(
            sync, "coordinator", step, start_s + 2 * step, {"tokens_per_s": 1000.0 * step, "queue_depth": 2.0}
        )
    sync.set(KEYS.policy_version, num_steps)
    sync.close()
    client = aioredis.Redis.from_url(redis_url)
    board = AsyncVersionBoard(client, KEYS)
    now = time.time()
    stale = VersionReport("rollout-1", "127.0.0.1:50052", num_steps - 2, ReportStatus.STALE, "fetch timed out", now)
    await board.report_version(stale)
    await board.report_version(VersionReport("rollout-0", "127.0.0.1:50051", num_steps, ReportStatus.OK, "", now))
    await client.aclose()
    return start_s


@asynccontextmanager
async def serving(redis_url: str, max_points: int = 600, port: int = 0):
    client = aioredis.Redis.from_url(redis_url)
    runner, bound_port = await start_dashboard(client, KEYS, "127.0.0.1", port, max_points=max_points)
    try:
        yield f"http://127.0.0.1:{bound_port}"
    finally:
        await runner.cleanup()
        await client.aclose()


async def get_state(base_url: str) -> dict:
    async with aiohttp.ClientSession() as session, session.get(base_url + "/api/state") as response:
        assert response.status == 200, await response.text()
        return msgspec.json.decode(await response.read())


def chart_lines(state: dict, chart_id: str) -> dict[str, dict]:
    (chart,) = [c for c in state["charts"] if c["id"] == chart_id]
    return {line["series"]: line for line in chart["lines"]}


def test_state_api_serves_every_role_in_order_with_fleet_and_derived_rates(redis_url):
    async def scenario():
        start_s = await write_run(redis_url)
        async with serving(redis_url) as base_url:
            state = await get_state(base_url)
            async with aiohttp.ClientSession() as session, session.get(base_url + "/") as page:
                assert page.status == 200 and "/dashboard.js" in await page.text()
        return start_s, state

    start_s, state = asyncio.run(scenario())
    assert state["run_id"] == "dash-test" and state["trainer_version"] == 5
    reward = chart_lines(state, "reward")["trainer/reward_mean"]
    assert reward["points"] == [[start_s + 2 * s, pytest.approx(0.5 + 0.05 * s)] for s in range(1, 6)]
    assert reward["latest"] == pytest.approx(0.75)
    tokens = chart_lines(state, "rollout_tokens")
    assert [v for _, v in tokens["coordinator/tokens_per_s"]["points"]] == [1000.0, 2000.0, 3000.0, 4000.0, 5000.0]
    assert tokens["rollout/tokens_per_s"] == {
        "series": "rollout/tokens_per_s",
        "label": "rollout reports",
        "points": [],
        "latest": None,
    }  # no rollout reports: "no data"
    # Throughput between consecutive trainer reports 2 s apart: 32 samples and 640 tokens per step.
    assert [v for _, v in chart_lines(state, "trainer_samples")["trainer/samples_per_s"]["points"]] == [16.0] * 4
    assert [v for _, v in chart_lines(state, "trainer_tokens")["trainer/tokens_per_s"]["points"]] == [320.0] * 4
    eval_lines = chart_lines(state, "eval_acc")
    assert list(eval_lines) == ["trainer/eval/gsm8k/acc"] and eval_lines["trainer/eval/gsm8k/acc"]["label"] == "gsm8k"
    assert state["staleness_hist"]["bins"] == [[0, 2], [1, 3]]  # fallback: per-step max staleness
    assert [(s["server_id"], s["policy_version"], s["lag_versions"], s["status"]) for s in state["servers"]] == [
        ("rollout-0", 5, 0, "OK"),
        ("rollout-1", 3, 2, "STALE"),
    ]
    assert state["servers"][1]["message"] == "fetch timed out" and 0 <= state["servers"][1]["age_s"] < 30
    assert state["roles"]["trainer"]["step"] == 5 and state["roles"]["rollout"] is None


def test_ring_buffer_keeps_only_the_newest_points_and_reads_each_report_once(redis_url):
    async def scenario():
        sync = redis.Redis.from_url(redis_url)
        for step in range(1, 9):
            write_metrics(sync, "trainer", step, 1000.0 + step, trainer_values(step))
        async with serving(redis_url, max_points=5) as base_url:
            first = await get_state(base_url)
            for step in range(9, 12):
                write_metrics(sync, "trainer", step, 1000.0 + step, trainer_values(step))
            await asyncio.sleep(0.6)  # past the dashboard's shared-refresh interval
            second = await get_state(base_url)
        sync.close()
        return first, second

    first, second = asyncio.run(scenario())

    def steps(state: dict) -> list[float]:
        return [t - 1000.0 for t, _ in chart_lines(state, "loss")["trainer/loss"]["points"]]

    assert steps(first) == [4.0, 5.0, 6.0, 7.0, 8.0]
    assert steps(second) == [7.0, 8.0, 9.0, 10.0, 11.0]
    assert second["roles"]["trainer"]["num_points"] == 5 and second["max_points"] == 5


def test_reported_staleness_counts_done_marker_and_bad_entries(redis_url):
    async def scenario():
        sync = redis.Redis.from_url(redis_url)
        values = {**trainer_values(1), "staleness_groups/0": 12.0, "staleness_groups/2": 3.0}
        write_metrics(sync, "trainer", 1, 1000.0, values)
        sync.xadd(KEYS.metrics("trainer"), {"m": b"not msgpack"})  # skipped with a warning, not fatal
        sync.hset(KEYS.fleet, "broken", b"\x00garbage")
        sync.xadd(KEYS.metrics("trainer"), {"d": encode(RoleDone("trainer", 1, 1, 1001.0))})
        sync.close()
        async with serving(redis_url) as base_url:
            return await get_state(base_url)

    state = asyncio.run(scenario())
    assert state["staleness_hist"] == {
        "source": "groups trained at each staleness (whole run)",
        "bins": [[0, 12.0], [2, 3.0]],
    }
    assert state["roles"]["trainer"]["done"] is True and state["roles"]["trainer"]["num_points"] == 1
    assert state["servers"] == [] and state["trainer_version"] is None


def test_start_dashboard_names_a_taken_port(redis_url):
    async def scenario():
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            async with serving(redis_url, port=taken.getsockname()[1]):
                pass

    with pytest.raises(DashboardPortTaken, match=r"dashboard port \d+ on 127.0.0.1 is already in use"):
        asyncio.run(scenario())


def test_state_api_answers_503_when_redis_is_unreachable():
    async def scenario():
        with socket.socket() as probe:  # a port with no server behind it
            probe.bind(("127.0.0.1", 0))
            dead_url = f"redis://127.0.0.1:{probe.getsockname()[1]}/0"
        async with serving(dead_url) as base_url, aiohttp.ClientSession() as session:
            async with session.get(base_url + "/api/state") as response:
                return response.status, await response.json()

    status, body = asyncio.run(scenario())
    assert status == 503 and body["error"].startswith("Redis unreachable")


# headless Chromium -------------------------------------------------------------------------------
class DomIndex(HTMLParser):
    """Text of the legend value labels (by data-series) and of the server table rows (by data-server-id)."""

    def __init__(self) -> None:
        super().__init__()
        self.latest: dict[str, str] = {}
        self.rows: dict[str, list[str]] = {}
        self.has_data: dict[str, str] = {}
        self._series: str | None = None
        self._row: str | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "span" and "data-series" in attrs:
            self._series = attrs["data-series"]
        if tag == "tr":
            self._row = attrs.get("data-server-id")
            if self._row:
                self.rows[self._row] = []
        if tag == "section" and "data-has-data" in attrs:
            self.has_data[attrs["id"]] = attrs["data-has-data"]

    def handle_data(self, data):
        if self._series:
            self.latest[self._series] = data
        elif self._row and data.strip():
            self.rows[self._row].append(data)

    def handle_endtag(self, tag):
        if tag == "span":
            self._series = None
        if tag == "tr":
            self._row = None


def find_chromium() -> str:
    for candidate in (os.environ.get("FLEETRL_CHROMIUM", ""), "/usr/bin/chromium", shutil.which("chromium") or ""):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    # `make test` installs it; a missing browser is a broken set-up, not a reason to pass quietly.
    pytest.fail("Chromium not installed: run scripts/install_chromium.sh (or set FLEETRL_CHROMIUM)")


async def render_page(chromium: str, url: str, out_dir: Path) -> str:
    """Load the page, let its polling run for 3 s of virtual time, save a screenshot; returns the DOM."""
    process = await asyncio.create_subprocess_exec(
        chromium,
        *CHROMIUM_FLAGS,
        f"--user-data-dir={out_dir / 'profile'}",
        "--window-size=1400,1300",
        "--hide-scrollbars",
        f"--screenshot={out_dir / 'dashboard.png'}",
        "--dump-dom",
        "--virtual-time-budget=3000",
        url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=90)
    except TimeoutError:
        os.killpg(process.pid, signal.SIGKILL)  # its renderer and GPU helpers live in its process group
        await process.wait()
        raise
    assert process.returncode == 0, stderr.decode(errors="replace")[-2000:]
    return stdout.decode()


def png_size_and_colors(path: Path) -> tuple[int, int, int]:
    """(width, height, distinct byte values of the pixel data) without an imaging library."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    offset, idat = 8, b""
    while offset < len(data):
        (length,), kind = struct.unpack(">I", data[offset : offset + 4]), data[offset + 4 : offset + 8]
        if kind == b"IDAT":
            idat += data[offset + 8 : offset + 8 + length]
        offset += 12 + length
    return width, height, len(set(zlib.decompress(idat)))


def test_page_draws_live_data_in_headless_chromium(redis_url, tmp_path):
    chromium = find_chromium()

    async def scenario():
        await write_run(redis_url)
        async with serving(redis_url) as base_url:
            return await render_page(chromium, base_url + "/", tmp_path)

    dom = DomIndex()
    dom.feed(asyncio.run(scenario()))
    assert dom.rows["rollout-0"][:4] == ["rollout-0", "127.0.0.1:50051", "v5", "0"]
    assert dom.rows["rollout-1"][2:5] == ["v3", "2", "STALE"]
    assert dom.latest["trainer/reward_mean"] == "0.750"
    assert dom.latest["coordinator/tokens_per_s"] == "5000"
    assert dom.latest["trainer/eval/gsm8k/acc"] == "0.450"
    assert dom.latest["rollout/weight_update_s"] == "no data"
    assert dom.has_data["chart-reward"] == "true" and dom.has_data["chart-staleness_hist"] == "true"
    screenshot = tmp_path / "dashboard.png"
    width, height, num_colors = png_size_and_colors(screenshot)
    assert (width, height) == (1400, 1300)
    assert screenshot.stat().st_size > 20_000 and num_colors > 50, "screenshot looks blank"
