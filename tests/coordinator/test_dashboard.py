"""Tests for coordinator.dashboard: the /api/state snapshot over real Redis (whole run, windows, the rollout servers'
live figures), and the page in headless Chromium (live rollout series, the range selector, a drag to zoom)."""

from __future__ import annotations

import asyncio
import math
import os
import random
import socket
import struct
import time
import zlib
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import msgspec
import pytest
import redis
import redis.asyncio as aioredis

from channels.metrics_stream import AsyncMetricsStreamWriter, MetricsStreamWriter
from channels.version_board import AsyncVersionBoard
from coordinator.dashboard import DashboardPortTaken, start_dashboard
from protos.records import MetricsReport, ReportStatus, RoleDone, VersionReport
from protos.redis_keys import RedisKeys
from tests.coordinator.browser import Browser
from tests.waiting import wait_until_async

pytestmark = pytest.mark.integration

KEYS = RedisKeys("dash-test")


def write_metrics(client: redis.Redis, role: str, step: int, time_s: float, values: dict[str, float]) -> None:
    """Append a report through the metrics channel, as the roles do."""
    assert MetricsStreamWriter(client, KEYS).post(MetricsReport(role, step, step, time_s, values))


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
async def serving(redis_url: str, capacity: int = 4096, port: int = 0):
    client = aioredis.Redis.from_url(redis_url)
    runner, bound_port = await start_dashboard(client, KEYS, "127.0.0.1", port, capacity=capacity)
    try:
        yield f"http://127.0.0.1:{bound_port}"
    finally:
        await runner.cleanup()
        await client.aclose()


async def get_state(base_url: str, query: str = "") -> dict:
    async with aiohttp.ClientSession() as session, session.get(base_url + "/api/state" + query) as response:
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
        "label": "rollout",
        "points": [],
        "latest": None,
    }  # no rollout reports: "no data"
    assert state["charts"][0]["id"] == "reward"  # what an operator looks at first
    assert state["window"]["from_s"] == state["window"]["run_from_s"] == start_s + 2  # the whole run
    # Throughput between consecutive trainer reports 2 s apart: 32 samples and 640 tokens per step.
    assert [v for _, v in chart_lines(state, "trainer_samples")["trainer/samples_per_s"]["points"]] == [16.0] * 4
    assert [v for _, v in chart_lines(state, "trainer_tokens")["trainer/tokens_per_s"]["points"]] == [320.0] * 4
    eval_lines = chart_lines(state, "eval_acc")
    assert list(eval_lines) == ["trainer/eval/gsm8k/acc"] and eval_lines["trainer/eval/gsm8k/acc"]["label"] == "gsm8k"
    assert state["staleness_hist"]["bins"] == [[1, 1]]  # no counts reported: the last step's max
    assert [(s["server_id"], s["policy_version"], s["lag_versions"], s["status"]) for s in state["servers"]] == [
        ("rollout-0", 5, 0, "OK"),
        ("rollout-1", 3, 2, "STALE"),
    ]
    assert state["servers"][1]["message"] == "fetch timed out" and 0 <= state["servers"][1]["age_s"] < 30
    assert state["roles"]["trainer"]["step"] == 5 and state["roles"]["rollout"] is None


def test_state_covers_the_whole_run_downsampled_and_a_window_on_request(redis_url):
    async def scenario():
        sync = redis.Redis.from_url(redis_url)
        for step in range(1, 2001):  # a long run: 2000 steps, 10 s apart
            write_metrics(sync, "trainer", step, 100000.0 + 10 * step, trainer_values(step))
        async with serving(redis_url, capacity=256) as base_url:
            whole = await get_state(base_url)
            window = await get_state(base_url, "?from=119000&to=119500")
            for step in range(2001, 2004):
                write_metrics(sync, "trainer", step, 100000.0 + 10 * step, trainer_values(step))

            async def refreshed() -> dict | None:  # once the dashboard's shared refresh (its interval) read them
                state = await get_state(base_url)
                return state if state["roles"]["trainer"]["num_points"] == 2003 else None

            later = await wait_until_async(refreshed, "the dashboard's state with steps 2001-2003", 10)
            async with aiohttp.ClientSession() as session, session.get(base_url + "/api/state?from=5&to=4") as bad:
                refused = (bad.status, await bad.text())
        sync.close()
        return whole, window, later, refused

    whole, window, later, refused = asyncio.run(scenario())
    loss = chart_lines(whole, "loss")["trainer/loss"]["points"]
    assert len(loss) <= 500 and loss[0][0] == 100010.0 and loss[-1][0] == 120000.0  # first to last report
    assert max(v for _, v in loss) == 1.0  # step 1's spike survives the merging and the downsampling
    assert whole["roles"]["trainer"]["num_points"] == 2000 and whole["max_chart_points"] == 500
    inside = chart_lines(window, "loss")["trainer/loss"]["points"]
    assert inside and all(119000.0 <= t <= 119500.0 for t, _ in inside)
    assert window["window"]["from_s"] == 119000.0 and window["window"]["to_s"] == 119500.0
    assert chart_lines(later, "loss")["trainer/loss"]["latest"] == pytest.approx(1.0 / 2003)  # reports read once
    assert later["roles"]["trainer"]["num_points"] == 2003
    assert refused[0] == 400 and "from must be before to" in refused[1]


def test_reported_staleness_counts_done_marker_and_bad_entries(redis_url):
    async def scenario():
        sync = redis.Redis.from_url(redis_url)
        values = {**trainer_values(1), "staleness_groups/0": 12.0, "staleness_groups/2": 3.0}
        write_metrics(sync, "trainer", 1, 1000.0, values)
        sync.xadd(KEYS.metrics("trainer"), {"m": b"not msgpack"})  # skipped with a warning, not fatal
        sync.hset(KEYS.fleet, "broken", b"\x00garbage")
        assert MetricsStreamWriter(sync, KEYS).post_done(RoleDone("trainer", 1, 1, 1001.0))
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


# live rollout series -----------------------------------------------------------------------------
def rollout_values(number: int, tokens_per_s: float) -> dict[str, float]:
    return {
        "tokens_per_s": tokens_per_s,
        "requests_running": float(round(5 + 2 * math.sin(number / 40))),
        "requests_waiting": 1.0,
        "kv_cache_usage": 0.25 + 0.05 * math.sin(number / 60),
        "policy_version": 5.0,
        "weight_update_s": 0.75,
        "weight_receive_s": 0.5,
        "weight_load_s": 0.125,
        "weight_paused_s": 0.25,
    }


async def report_rollout(client: aioredis.Redis, server_id: str, number: int, tokens_per_s: float) -> None:
    """One rollout server report through the channel, as RolloutReporter writes it."""
    report = MetricsReport("rollout", number, 5, time.time(), rollout_values(number, tokens_per_s), server_id)
    assert await AsyncMetricsStreamWriter(client, KEYS).post(report)


def test_rollout_reports_feed_one_series_per_server_and_the_server_table(redis_url):
    async def scenario():
        await write_run(redis_url)
        client = aioredis.Redis.from_url(redis_url)
        for number in range(3):
            await report_rollout(client, "rollout-0", number, 100.0 * (number + 1))
        await report_rollout(client, "rollout-1", 0, 50.0)
        await client.aclose()
        async with serving(redis_url) as base_url:
            return await get_state(base_url)

    state = asyncio.run(scenario())
    tokens = chart_lines(state, "rollout_tokens")
    assert [v for _, v in tokens["rollout/rollout-0/tokens_per_s"]["points"]] == [100.0, 200.0, 300.0]
    assert tokens["rollout/rollout-1/tokens_per_s"]["label"] == "rollout-1"
    assert chart_lines(state, "weight_update")["rollout/rollout-0/weight_update_s"]["latest"] == 0.75
    row = next(r for r in state["servers"] if r["server_id"] == "rollout-0")
    assert row["live"]["tokens_per_s"] == 300.0 and row["live"]["weight_receive_s"] == 0.5 and row["live"]["age_s"] < 60
    assert state["roles"]["rollout"]["num_sources"] == 2 and state["roles"]["rollout"]["num_points"] == 4


# headless Chromium -------------------------------------------------------------------------------
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


async def write_long_history(redis_url: str, hours: float = 2.0) -> float:
    """A run of ``hours`` so far, up to now: every 10 s a trainer step, a coordinator report and a report of each of
    two rollout servers, with noisy, learning-like figures (seeded); returns its start."""
    noise = random.Random(0)
    sync = redis.Redis.from_url(redis_url)
    writer = MetricsStreamWriter(sync, KEYS)
    num_steps = int(hours * 360)
    start_s = time.time() - 10 * num_steps
    for step in range(1, num_steps + 1):
        time_s, progress = start_s + 10 * step, step / num_steps
        reward = 0.15 + 0.55 * (1 - math.exp(-4 * progress)) + noise.gauss(0, 0.03)
        values = {
            **trainer_values(step),
            "reward_mean": reward,
            "loss": 0.4 * math.exp(-3 * progress) + abs(noise.gauss(0, 0.02)),
            "queue_depth": float(round(3 + 2 * math.sin(step / 25) + noise.random())),
            "staleness_max": float(noise.random() < 0.7),
            "staleness_mean": 0.5 + noise.gauss(0, 0.1),
            "samples_trained": 64.0 * step,
            "num_tokens": 640.0 + noise.randint(-60, 60),
            "eval/gsm8k/acc": 0.2 + 0.5 * progress,
        }
        write_metrics(sync, "trainer", step, time_s, values)
        fleet = {"tokens_per_s": 880.0 + noise.gauss(0, 40), "queue_depth": float(round(3 + 2 * math.sin(step / 25)))}
        write_metrics(sync, "coordinator", step, time_s, fleet)
        for index in range(2):
            rollout = rollout_values(step, 430.0 + 20 * index + noise.gauss(0, 25))
            assert writer.post(MetricsReport("rollout", step, step, time_s, rollout, f"rollout-{index}"))
    sync.set(KEYS.policy_version, num_steps)
    sync.close()
    return start_s


async def keep_reporting(redis_url: str, stop: asyncio.Event) -> None:
    """Two rollout servers reporting every 0.3 s with changing figures, and their fleet reports."""
    client = aioredis.Redis.from_url(redis_url)
    board = AsyncVersionBoard(client, KEYS)
    number = 0
    while not stop.is_set():
        for index in range(2):
            server_id = f"rollout-{index}"
            await report_rollout(client, server_id, number, 400.0 + 40 * index + 25 * (number % 7))
            address = f"127.0.0.1:5005{index + 1}"
            await board.report_version(
                VersionReport(server_id, address, 720, ReportStatus.OK, "", time.time(), 0.75, 0.25)
            )
        number += 1
        try:
            await asyncio.wait_for(stop.wait(), timeout=0.3)
        except TimeoutError:
            pass
    await client.aclose()


LEGEND = "document.querySelector('[data-series=\"rollout/rollout-0/tokens_per_s\"]')?.textContent"
RUNNING_CELL = 'document.querySelector(\'tr[data-server-id="rollout-1"] td[data-live="tokens_per_s"]\')?.textContent'
REWARD_POINTS = 'Number(document.getElementById("chart-reward")?.getAttribute("data-num-points") || 0)'
WINDOW = "[document.body.dataset.selection, Number(document.body.dataset.windowFrom), Number(document.body.dataset.windowTo)]"


def test_page_shows_live_rollout_series_and_zooms_in_headless_chromium(redis_url, tmp_path):
    async def scenario():
        start_s = await write_long_history(redis_url)
        stop = asyncio.Event()
        reporting = asyncio.create_task(keep_reporting(redis_url, stop))
        try:
            async with serving(redis_url) as base_url, await Browser.start(tmp_path / "profile") as browser:
                await browser.navigate(base_url + "/")
                return start_s, await drive_the_page(browser, tmp_path / "dashboard.png")
        finally:
            stop.set()
            await reporting

    start_s, seen = asyncio.run(scenario())
    assert seen["first_card"] == "chart-reward"  # the reward curve comes first
    assert seen["legend"][0] != seen["legend"][1], "the rollout series did not move between polls"
    assert seen["table"] not in ("", "-")
    mode, window_from, window_to = seen["whole"]
    assert mode == "all" and abs(window_from - (start_s + 10)) < 1e-3  # the whole run: 2 h
    assert 100 < seen["whole_points"] <= 500
    mode, last_from, last_to = seen["last10"]
    assert mode == "last" and 590 < last_to - last_from < 700
    mode, zoom_from, zoom_to = seen["zoomed"]
    assert mode == "fixed" and last_from < zoom_from < zoom_to < last_to and zoom_to - zoom_from < 500
    assert seen["hash"].startswith("#from=") and 0 < seen["zoomed_points"] < seen["whole_points"]
    width, height, num_colors = png_size_and_colors(seen["screenshot"])
    assert (width, height) == (1400, 1300) and num_colors > 50, "screenshot looks blank"
    target = os.environ.get("FLEETRL_DASHBOARD_SCREENSHOT")  # docs/images/dashboard.png is made this way
    if target:
        from PIL import Image  # a 256-colour palette: the committed copy stays small

        Image.open(seen["screenshot"]).quantize(colors=256).save(target, optimize=True)


async def drive_the_page(browser: Browser, screenshot: Path) -> dict:
    """What the page shows: live rollout figures, the whole run, then the last 10 min, then a dragged range."""
    seen = {"legend": [await browser.wait_for(LEGEND + ' !== "no data" && ' + LEGEND, "a rollout-0 tok/s value")]}
    first = seen["legend"][0]
    seen["legend"].append(await browser.wait_for(f"{LEGEND} !== {first!r} && {LEGEND}", "a newer rollout value"))
    seen["table"] = await browser.wait_for(f"{RUNNING_CELL} !== '-' && {RUNNING_CELL}", "rollout-1's tok/s cell")
    seen["first_card"] = await browser.evaluate('document.querySelector("#charts section").id')
    seen["whole"] = await browser.wait_for(f"document.body.dataset.windowFrom && {WINDOW}", "the whole run's window")
    seen["whole_points"] = await browser.evaluate(REWARD_POINTS)
    await browser.evaluate("document.querySelector('#range button[data-range=\"600\"]').click()")
    seen["last10"] = await browser.wait_for(f'document.body.dataset.selection === "last" && {WINDOW}', "10 minutes")
    box = await browser.evaluate(
        '(() => { const r = document.querySelector("#chart-reward canvas").getBoundingClientRect();'
        " return [r.left, r.top, r.width, r.height]; })()"
    )
    left, top, width, height = box
    await browser.drag(
        left + 54 + 0.25 * (width - 66), top + height / 2, left + 54 + 0.6 * (width - 66), top + height / 2
    )
    seen["zoomed"] = await browser.wait_for(
        f'document.body.dataset.selection === "fixed" && {WINDOW}', "the dragged range"
    )
    seen["hash"] = await browser.evaluate("window.location.hash")
    seen["zoomed_points"] = await browser.wait_for(REWARD_POINTS, "reward points in the dragged range")
    await browser.evaluate("document.querySelector('#range button[data-range=\"all\"]').click()")
    await browser.wait_for(
        f'document.body.dataset.selection === "all" && {REWARD_POINTS} >= {seen["whole_points"]}', "the whole run again"
    )
    await browser.evaluate("new Promise(done => requestAnimationFrame(() => requestAnimationFrame(() => done(1))))")
    seen["screenshot"] = await browser.screenshot(screenshot)
    return seen
