"""One real end-to-end run of `fleetrl demo`: every role a process, two vLLM servers, Redis, weight bus."""

from __future__ import annotations

import json
import subprocess
import sys

import psutil
import pytest

from modeling.tiny_model import init_tiny


@pytest.mark.timeout(600)
def test_short_demo_trains_publishes_and_stays_within_staleness_bound(tmp_path):
    model = init_tiny(tmp_path / "model")
    out = tmp_path / "run"
    before = {p.pid for p in psutil.process_iter()}
    result = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "demo", "--steps", "3", "--out", str(out),
         f"model_path={model}", "coordinator.groups_per_step=4", "coordinator.group_size=4",
         "coordinator.admin_port=0"],  # a free port: another demo on this machine may hold the default
        capture_output=True, text=True, timeout=580,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3
    assert summary["trajectories_trained"] == 3 * 4 * 4
    assert summary["trajectories_produced"] >= summary["trajectories_trained"]
    assert summary["max_staleness_seen"] <= summary["max_staleness_allowed"] == 1
    assert summary["weight_versions_published"] == 3
    assert summary["rollout_servers"] == 2
    assert set(summary["rollout_server_versions"].values()) == {3}
    # Every process the demo started is gone (no orphaned engines or Redis).
    leftovers = [
        p for p in psutil.process_iter(["pid", "cmdline"])
        if p.pid not in before and any(s in " ".join(p.info["cmdline"] or []) for s in ("rollout_service", "trainer_service", "valkey-server", "coordinator run"))
    ]
    assert not leftovers, [p.info["cmdline"] for p in leftovers]
