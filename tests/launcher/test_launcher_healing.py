"""`fleetrl demo` heals: a rollout server SIGKILLed mid-run is restarted by the launcher, catches up to the current
version, registers at its new address, is discovered and served; the coordinator SIGKILLed is restarted and continues
from its prompt cursor; the embedded valkey SIGKILLed is restarted on its address with the queue from its append-only
file; the run completes with its summary and every group trained once."""

from __future__ import annotations

import grpc
import pytest

from modeling.tiny_model import init_tiny
from protos import admin_pb2
from tests.launcher.healing_runs import GROUPS_PER_STEP, assert_every_group_trained_once, launch

pytestmark = pytest.mark.e2e


def resumed(run) -> bool:
    try:
        run.stub.Resume(admin_pb2.ResumeRequest(), timeout=10)
        return True
    except grpc.RpcError:
        return False


STEPS = 8


@pytest.mark.timeout(900)
def test_demo_restarts_a_killed_rollout_server_valkey_and_coordinator_and_completes(tmp_path):
    model = init_tiny(tmp_path / "model")
    run = launch(["demo"], tmp_path / "run", str(model), STEPS)
    try:
        run.wait_for(lambda: (s := run.status()) and s.groups_pushed >= GROUPS_PER_STEP, "the first step's groups", 600)
        before = next(s for s in run.status().servers if s.server_id == "rollout-1")
        run.kill_role("rollout-1")  # mid-run: its open calls go to rollout-0
        # Hold admission while the replacement's engine starts, so that the run is still going when it is back.
        run.stub.Pause(admin_pb2.PauseRequest(), timeout=10)
        back = run.wait_replaced("rollout-1", before.address, timeout_s=600)
        run.stub.Resume(admin_pb2.ResumeRequest(), timeout=10)
        run.wait_served(back.address, timeout_s=120)
        # The embedded valkey killed mid-run (issue 26: nothing restarted it and the run was aborted): restarted on
        # its address, its append-only file brings the queue back. Admission held so the run outlasts the outage.
        run.stub.Pause(admin_pb2.PauseRequest(), timeout=10)
        run.kill_role("valkey")
        run.wait_for(lambda: run.roles()["valkey"]["restarts"] == 1, "valkey restarted", 60)
        run.wait_for(lambda: resumed(run), "the coordinator's admin API to take a resume after the outage", 120)
        # The coordinator killed mid-run: restarted, it finds the servers in Redis and continues the prompt stream.
        pushed = run.status().groups_pushed
        assert pushed < STEPS * GROUPS_PER_STEP, "the run ended before the coordinator could be killed"
        run.kill_role("coordinator")
        summary = run.finish(timeout_s=600)
    finally:
        run.stop()
    assert summary["restarts"] == {"valkey": 1, "rollout-0": 0, "rollout-1": 1, "trainer": 0, "coordinator": 1}
    assert_every_group_trained_once(summary, run.out, STEPS)
    assert summary["rollout_servers"] == 2 and set(summary["rollout_server_versions"].values()) == {STEPS}
    output = run.output.read_text()
    assert (
        "rollout-1 exited with code -9; restart 1 in 0.5s" in output
        and "rollout-1 restarted (1 of at most 3)" in output
    )
    coordinator_log = (run.out / "logs" / "coordinator.log").read_text()
    assert "discovered" in coordinator_log  # the servers were found in Redis (no --servers)
    assert "coordinator restart: task echo continues at" in coordinator_log
