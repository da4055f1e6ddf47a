"""The chaos soak's own parts without a run: the seeded schedule and the audit's checks, on hand-made stream entries,
ledgers and reports (each check must catch what it is there for, or a passing soak proves nothing)."""

from __future__ import annotations

import pytest

from protos.records import MetricsReport
from tests.chaos.audit import (
    PushedGroup,
    exactly_once_problems,
    faults_problems,
    faults_section,
    staleness_problems,
    time_lost_s,
)
from tests.chaos.harness import FaultRecord
from tests.chaos.schedule import (
    CONNECTION_CUT,
    KILL_ROLLOUT,
    KILL_TRAINER,
    KINDS,
    REDIS_RESTART,
    STEP_S,
    SoakSize,
    count_by_kind,
    expected_restarts,
    make_schedule,
)

pytestmark = pytest.mark.unit

SIZE = SoakSize(num_steps=40, faults_per_kind=dict.fromkeys(KINDS, 2))
ROLES = ["rollout-0", "rollout-1", "trainer", "coordinator"]


def test_a_schedule_is_a_function_of_its_seed_with_every_fault_inside_its_window():
    schedule = make_schedule(7, SIZE, num_rollout_servers=2)
    assert schedule == make_schedule(7, SIZE, num_rollout_servers=2)
    assert schedule != make_schedule(8, SIZE, num_rollout_servers=2)
    assert count_by_kind(schedule) == dict.fromkeys(KINDS, 2)
    assert [f.after_step for f in schedule] == sorted(f.after_step for f in schedule)
    for fault in schedule:
        last = (40 - SIZE.last_steps_free) // 2 if fault.kind == KILL_ROLLOUT else 40 - SIZE.last_steps_free
        assert SIZE.first_step <= fault.after_step <= last, fault
        assert (fault.duration_s > 0) == (fault.kind in (REDIS_RESTART, CONNECTION_CUT)), fault
        assert 0.0 <= fault.delay_s <= STEP_S, fault  # inside about a step: the schedule keeps up with a fast run
    assert {f.target for f in schedule if f.kind == KILL_ROLLOUT} <= {"rollout-0", "rollout-1"}


def test_sizes_that_leave_no_room_or_name_unknown_faults_are_refused():
    with pytest.raises(ValueError, match="num_steps=6 leaves no step for faults"):
        SoakSize(num_steps=6, faults_per_kind={KILL_TRAINER: 1})
    with pytest.raises(ValueError, match=r"unknown fault kinds \['kill_redis'\]"):
        SoakSize(num_steps=40, faults_per_kind={"kill_redis": 1})


def pushed(group_id: str, *versions: tuple[int, int], entry_ms: int = 1000) -> PushedGroup:
    return PushedGroup(f"{entry_ms}-0", group_id, versions)


def test_exactly_once_finds_lost_unknown_repeated_and_untrained_groups():
    groups = [pushed("g0", (0, 0)), pushed("g1", (0, 0)), pushed("g2", (0, 0)), pushed("g3", (1, 1))]
    state = {"step": 2, "ledger": {"g0": "trained", "g1": "trained", "g2": "trained", "g3": "trained"}}
    assert exactly_once_problems(groups, state, num_steps=2, groups_per_step=2) == []
    lost = {"step": 2, "ledger": {"g0": "trained", "g1": "trained", "g2": "stale", "g9": "trained"}}
    problems = exactly_once_problems([*groups, pushed("g1", (0, 0))], lost, num_steps=2, groups_per_step=2)
    assert any("pushed more than once: ['g1']" in p for p in problems)
    assert any("(lost): ['g3']" in p for p in problems)
    assert any("never pushed: ['g9']" in p for p in problems)
    assert any("not trained: {'g2': 'stale'}" in p for p in problems)


def test_sample_staleness_is_checked_per_sample_against_the_version_that_trained_it():
    state = {
        "ledger": {"g0": "trained", "g1": "trained", "g2": "trained"},
        "trained_versions": {"g0": 3, "g1": 3, "g2": 2},
    }
    fine = [pushed("g0", (2, 3), (3, 3)), pushed("g1", (3, 3))]
    problems, histogram = staleness_problems(fine, state, max_staleness=1)
    assert problems == [] and histogram == {0: 2, 1: 1}
    # one sample two versions old; one token newer than the weights that trained it
    problems, _ = staleness_problems([pushed("g0", (3, 3), (1, 3)), pushed("g2", (2, 3))], state, max_staleness=1)
    assert problems == [
        "group g0 sample 1: token versions 1..3 trained by v3 (bound 1)",
        "group g2 sample 0: token versions 2..3 trained by v2 (bound 1)",
    ]


def report(step: int, time_s: float) -> MetricsReport:
    return MetricsReport("trainer", step, step, time_s, {})


def test_time_lost_runs_from_the_fault_to_the_next_new_step_after_it_ended():
    reports = [report(1, 10.0), report(2, 11.0), report(3, 20.0), report(4, 21.0)]
    schedule = make_schedule(1, SoakSize(num_steps=12, faults_per_kind={KILL_TRAINER: 1}), 2)
    record = FaultRecord(schedule[0], step_before=2, injected_s=11.5, ended_s=11.5, recovered_s=15.0)
    assert time_lost_s(record, reports) == pytest.approx(8.5)
    # a cut over at 20.5: the step reported at 20.0 was made during it, progress is the next one
    cut = FaultRecord(schedule[0], step_before=2, injected_s=19.0, ended_s=20.5, recovered_s=20.6)
    assert time_lost_s(cut, reports) == pytest.approx(2.0)
    late = FaultRecord(schedule[0], step_before=4, injected_s=22.0, ended_s=22.0, recovered_s=23.0)
    assert time_lost_s(late, reports) is None


def test_the_faults_section_counts_and_its_check_flags_unexplained_restarts_and_missing_recoveries():
    schedule = make_schedule(3, SoakSize(num_steps=20, faults_per_kind={KILL_TRAINER: 1, REDIS_RESTART: 1}), 2)
    records = [FaultRecord(f, step_before=5, injected_s=100.0, ended_s=101.0, recovered_s=102.0) for f in schedule]
    reports = [report(5, 99.0), report(6, 104.0)]
    roles = {name: {"restarts": 0} for name in ROLES} | {"trainer": {"restarts": 1}}
    faults = faults_section(3, schedule, records, roles, reports)
    assert faults["injected"] == faults["recovered"] == faults["scheduled"] == count_by_kind(schedule)
    assert (
        faults["expected_restarts"] == expected_restarts(schedule, ROLES) == {**dict.fromkeys(ROLES, 0), "trainer": 1}
    )
    assert faults["time_lost_s"][KILL_TRAINER]["median"] == pytest.approx(4.0)
    assert faults_problems(faults) == []
    # the coordinator restarted with no kill to explain it (it crashed), and a fault that never recovered
    roles["coordinator"] = {"restarts": 1}
    records[0].recovered_s = 0.0
    problems = faults_problems(faults_section(3, schedule, records, roles, reports))
    assert any("the kills explain" in p for p in problems) and any(p.startswith("recovered") for p in problems)
