"""The GPU chaos section's arithmetic (scripts/gpu_chaos_report.py) on hand-made step reports, streams and ledgers:
each figure must show what it is there for, or a passing GPU run proves nothing. The section itself needs a demo
run (its CPU dry run: FLEETRL_GPU_CHECKS_DRY=1 scripts/gpu_checks.py --sections chaos)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "gpu_chaos_report.py"
_SPEC = importlib.util.spec_from_file_location("gpu_chaos_report", _PATH)
report = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = report  # its dataclasses look their module up while the file executes
_SPEC.loader.exec_module(report)


def steps_every_second(last: int, gap_after: int = 0, gap_s: float = 0.0) -> list:
    """Step k reported at k seconds, and ``gap_s`` more from the step after ``gap_after`` on."""
    return [report.StepReport(k, k, k + (gap_s if gap_after and k > gap_after else 0.0)) for k in range(1, last + 1)]


def test_time_lost_is_the_faults_window_less_the_median_step():
    reports = steps_every_second(10, gap_after=5, gap_s=3.0)  # step 6 at 9.0 instead of 6.0
    fault = report.FaultRecord("kill_trainer", "trainer", 5, injected_s=5.5, restarted_s=6.0)
    median_s = report.median_step_interval_s(reports, [fault])
    assert median_s == 1.0  # the 4 s interval around the fault is not the run's pace
    assert report.time_lost(fault, reports, median_s) == {
        "next_step_after_s": 3.5,
        "window_s": 4.0,
        "steps_in_window": 1,
        "time_lost_s": 3.0,
    }


def test_a_killed_servers_stall_after_the_queued_steps_counts_until_its_replacement_serves():
    # steps 6 and 7 come from the queue after the kill at 5.5; the run stalls until the replacement serves at 30
    reports = steps_every_second(7) + [report.StepReport(k, k, 24.0 + k) for k in range(8, 12)]
    fault = report.FaultRecord("kill_rollout", "rollout-0", 5, injected_s=5.5, restarted_s=7.0, serving_s=30.0)
    median_s = report.median_step_interval_s(reports, [fault])
    assert median_s == 1.0  # the stall (7.0 -> 32.0) is inside the window, not the run's pace
    figures = report.time_lost(fault, reports, median_s)
    assert figures["next_step_after_s"] == 0.5  # the queue hid the kill for two steps
    assert (figures["window_s"], figures["steps_in_window"], figures["time_lost_s"]) == (27.0, 3, 24.0)
    row = report.fault_rows([{**figures, **_event(fault)}])[0]
    assert row == "| kill_rollout | 5 | 1.0 | n/a | 0.5 | 27.0 (3) | 24.0 |"


def test_a_restarted_trainers_reports_of_replayed_steps_are_not_new_steps():
    replayed = [report.StepReport(k, k, 20.0 + k / 100) for k in (4, 5)]  # re-reported at its restart
    reports = steps_every_second(5) + replayed + [report.StepReport(6, 6, 21.0), report.StepReport(7, 7, 22.0)]
    fault = report.FaultRecord("kill_trainer", "trainer", 5, injected_s=5.5, restarted_s=8.0)
    median_s = report.median_step_interval_s(reports, [fault])
    assert median_s == 1.0
    assert report.time_lost(fault, reports, median_s)["window_s"] == 16.0  # step 5 at 5.0 to step 6 at 21.0


def test_a_fault_the_run_made_no_step_after_has_no_time_lost():
    reports = steps_every_second(5)
    fault = report.FaultRecord("kill_rollout", "rollout-0", 5, injected_s=5.5, restarted_s=6.5)
    assert report.time_lost(fault, reports, 1.0)["time_lost_s"] is None
    row = report.fault_rows([{**report.time_lost(fault, reports, 1.0), **_event(fault)}])[0]
    assert row == "| kill_rollout | 5 | 1.0 | n/a | n/a | n/a | n/a |"


def _event(fault) -> dict:
    return {"kind": fault.kind, "step_before": fault.step_before, "restarted_after_s": 1.0, "serving_after_s": None}


def _run(num_groups: int = 4, samples: int = 4, stale: int = 0) -> tuple[list, dict]:
    pushed = [report.PushedGroup(f"g{i}", samples) for i in range(num_groups)]
    ledger = {g.group_id: ("stale" if i < stale else "trained") for i, g in enumerate(pushed)}
    totals = {"samples_trained": (num_groups - stale) * samples, "stale_dropped": stale * samples}
    return pushed, {"ledger": ledger, "totals": totals, "policy_version": 3}


def test_every_group_consumed_once_passes_with_its_counts():
    pushed, state = _run(stale=1)
    once = report.exactly_once(pushed, state)
    assert once["passed"]
    assert (once["groups_pushed"], once["groups_trained"], once["groups_stale"]) == (4, 3, 1)
    assert (once["trajectories_produced"], once["trajectories_trained"]) == (16, 12)


@pytest.mark.parametrize(
    "break_it, figure",
    [
        (lambda pushed, state: pushed.append(pushed[0]), "groups_pushed_twice"),
        (lambda pushed, state: state["ledger"].pop("g2"), "groups_never_consumed"),
        (lambda pushed, state: state["ledger"].update(g9="trained"), "groups_never_pushed"),
        (lambda pushed, state: state["totals"].update(samples_trained=20), "trajectories_trained"),  # one twice
    ],
)
def test_exactly_once_fails_on_a_group_pushed_twice_lost_unknown_or_trained_twice(break_it, figure):
    pushed, state = _run()
    break_it(pushed, state)
    once = report.exactly_once(pushed, state)
    assert not once["passed"]
    assert once[figure] not in ([], 16)


def test_final_versions_agree_only_when_every_server_serves_the_trainers_last_version():
    _, state = _run()
    reports = [report.StepReport(3, 3, 3.0)]
    agreed = report.final_versions(state, reports, {"rollout_server_versions": {"rollout-0": 3}})
    assert agreed["agree"] and agreed["trainer"] == 3
    behind = report.final_versions(state, reports, {"rollout_server_versions": {"rollout-0": 2}})
    assert not behind["agree"]
    assert not report.final_versions(state, reports, {})["agree"]  # no server known: nothing shown to agree
