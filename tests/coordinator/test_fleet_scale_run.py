"""A small run of benchmarks/fleet_scale.py (2 and 8 stand-in servers, a real coordinator process, the light
trainer) and of benchmarks/queue_throughput.py: the figures they print are all there and sane (not timings)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO_ROOT = Path(__file__).resolve().parents[2]
FIGURES = (
    "cpu_s_per_1k_traj",
    "dispatch_p50_ms",
    "dispatch_p99_ms",
    "routing_p50_ms",
    "routing_p99_ms",
    "push_traj_per_s",
    "status_p50_ms",
    "status_p99_ms",
)


def run_benchmark(script: str, *args: str, timeout_s: float = 600) -> dict:
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_fleet_scale_measures_every_size_and_plots_them(tmp_path):
    plot = tmp_path / "fleet.png"
    summary = run_benchmark(
        "fleet_scale.py",
        "--sizes",
        "2,8",
        "--trajectories",
        "480",
        "--warmup-trajectories",
        "160",
        "--groups-per-step",
        "4",
        "--plot",
        str(plot),
    )
    assert summary["sizes"] == [2, 8] and [r["servers"] for r in summary["results"]] == [2, 8]
    for result in summary["results"]:
        assert result["trajectories"] >= 480  # counted from where the window opened
        assert all(result[name] > 0 for name in FIGURES), result
        assert result["routing_p50_ms"] <= result["routing_p99_ms"] <= result["dispatch_p99_ms"]
        assert result["status_calls"] > 0
        assert result["idle_cpu_ms_per_s"] > 0 and 0 < result["work_cpu_s_per_1k_traj"] <= result["cpu_s_per_1k_traj"]
    ratio = summary["results"][1]["cpu_s_per_1k_traj"] / summary["results"][0]["cpu_s_per_1k_traj"]
    assert summary["cpu_ratio_max_vs_min"] == pytest.approx(ratio, rel=0.01)
    assert summary["routing_p99_ms_max"] == max(r["routing_p99_ms"] for r in summary["results"])
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_queue_throughput_compares_the_channel_with_raw_commands_on_each_shape():
    summary = run_benchmark("queue_throughput.py", "--shapes", "2x64,4x16", "--groups", "40", "--rounds", "1")
    assert set(summary["shapes"]) == {"2x64", "4x16"}
    for shape in summary["shapes"].values():
        assert shape["channel_traj_s"] > 0 and shape["raw_traj_s"] > 0
        assert shape["ratio"] == pytest.approx(shape["channel_traj_s"] / shape["raw_traj_s"], rel=0.01, abs=1e-3)
        assert shape["ratio"] > 0.05, "a side waited on a read timeout"
        assert shape["group_bytes"] > 0
    assert summary["min_ratio"] == min(shape["ratio"] for shape in summary["shapes"].values())
