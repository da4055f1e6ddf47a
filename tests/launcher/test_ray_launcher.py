"""`fleetrl up --ray local` on this machine: the demo recipe's roles, each process owned by a Ray actor.

One run (a Ray cluster and vLLM engines are the slow part) proves the launcher's promises in turn: a rollout server
SIGKILLed mid-run is replaced and serves at the current version; `fleetrl scale` adds a replica and removes one,
which drains and leaves the fleet; the trainer SIGKILLed is restarted from its checkpoint; the embedded valkey
SIGKILLed comes back on its address with its append-only file; the run completes with the
summary checks of the demo's end-to-end test, every group trained exactly once, and the restarts counted per role.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from modeling.tiny_model import init_tiny
from protos import admin_pb2
from tests.launcher.healing_runs import GROUPS_PER_STEP, LaunchedRun, assert_every_group_trained_once, launch

pytestmark = pytest.mark.e2e

STEPS = 8


def _scale(run: LaunchedRun, count: int) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "scale", f"rollout={count}", "--run-dir", str(run.out)],
        capture_output=True,
        text=True,
        timeout=700,
    )
    assert done.returncode == 0, done.stdout + done.stderr + run.text()
    return done.stdout


def _addresses(run: LaunchedRun) -> dict[str, str]:
    return {s.server_id: s.address for s in run.status().servers}


@pytest.mark.timeout(1200)
def test_fleetrl_up_heals_scales_and_trains_every_group_once(tmp_path):
    model = init_tiny(tmp_path / "model")
    run = launch(
        ["up", "recipes/demo-echo.yaml", "--ray", "local"],
        tmp_path / "run",
        str(model),
        STEPS,
        "launcher.ray.num_cpus=8",
    )
    try:
        run.wait_for(lambda: (s := run.status()) and s.groups_pushed >= GROUPS_PER_STEP, "the first step's groups", 600)
        before = _addresses(run)
        run.kill_role("rollout-1")  # mid-run: its open calls go to rollout-0
        run.stub.Pause(admin_pb2.PauseRequest(), timeout=10)  # the run must still be going once it is back
        assert "3 rollout replicas serving" in _scale(run, 3)  # a new replica while rollout-1 restarts
        back = run.wait_replaced("rollout-1", before["rollout-1"], timeout_s=600)
        added = run.wait_for(lambda: _addresses(run).get("rollout-2"), "rollout-2 in the fleet", 120)
        assert "2 rollout replicas serving" in _scale(run, 2)  # the newest leaves: it drains and deregisters
        run.wait_for(lambda: added not in _addresses(run).values(), "rollout-2 out of the fleet", 60)
        assert "rollout-2" not in run.roles()
        run.kill_role("trainer")
        run.stub.Resume(admin_pb2.ResumeRequest(), timeout=10)
        run.wait_served(back.address, timeout_s=120)
        run.kill_role("valkey")  # the Redis fleetrl up started: back on its address with its AOF, nothing lost
        summary = run.finish(timeout_s=600)
    finally:
        run.stop()
    assert summary["launcher"] == "ray"
    assert summary["restarts"] == {"rollout-0": 0, "rollout-1": 1, "coordinator": 0, "valkey": 1, "trainer": 1}
    assert_every_group_trained_once(summary, run.out, STEPS)
    assert summary["trajectories_produced"] >= summary["trajectories_trained"]
    versions = set(summary["rollout_server_versions"].values())
    assert summary["rollout_servers"] == 2 and len(versions) == 1 and versions.pop() >= STEPS
    trainer_log = (run.out / "logs" / "trainer.log").read_text()
    starts = [line for line in trainer_log.splitlines() if "trainer start: step" in line]
    assert len(starts) == 2 and "trainer start: step 0," not in starts[1], starts  # resumed from its checkpoint
    assert "fleetrl: rollout-2 stopped" in run.output.read_text()
