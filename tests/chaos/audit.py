"""What the chaos soak checks after its run, from what the run left: the trajectory stream (kept whole:
``trainer.trim_acknowledged=false``), the trainer's last checkpoint (its ledger and the version each group's step
updated), the trainer's metrics stream (a report per step, with the time it was made), roles.json and the summary.

Each check returns the problems it found (an empty list: none), so that a failing soak names all of them at once.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import redis

from protos.records import MetricsReport, decode_group, decode_metrics
from protos.redis_keys import RedisKeys, as_text
from tests.chaos.harness import FaultRecord
from tests.chaos.schedule import KILL_ROLLOUT, KINDS, Fault, count_by_kind, expected_restarts

# a killed rollout server's replacement must serve again within this (a CPU engine starts in 30-60 s on 2 cores)
SERVING_DEADLINE_S = 180.0


@dataclass(frozen=True)
class PushedGroup:
    """One entry of the trajectory stream, reduced to what the audit needs."""

    entry_id: str
    group_id: str
    sample_versions: tuple[tuple[int, int], ...]  # per sample: (oldest, newest) token version

    @property
    def pushed_s(self) -> float:
        return int(self.entry_id.split("-")[0]) / 1000.0  # XADD '*' ids are the server's clock in ms


def read_pushed(client: redis.Redis, keys: RedisKeys) -> list[PushedGroup]:
    """Every entry ever pushed on the run's trajectory stream, oldest first."""
    pushed, start = [], "-"
    while True:
        page = client.xrange(keys.trajectories, min=start, count=500)
        for entry_id, fields in page:
            group = decode_group(fields[b"g"])
            versions = tuple(_token_versions(sample) for sample in group.samples)
            pushed.append(PushedGroup(as_text(entry_id), group.group_id, versions))
        if len(page) < 500:
            return pushed
        start = "(" + as_text(page[-1][0])


def _token_versions(sample) -> tuple[int, int]:
    """(oldest, newest) version among a sample's tokens; (-1, -1) when it carries none."""
    versions = [span.version for span in sample.version_spans]
    return (min(versions), max(versions)) if versions else (-1, -1)


def trainer_reports(client: redis.Redis, keys: RedisKeys) -> list[MetricsReport]:
    """The trainer's step reports in the order they were made (every incarnation's)."""
    entries = client.xrange(keys.metrics("trainer"))
    return [decode_metrics(fields[b"m"]) for _, fields in entries if b"m" in fields]


def latest_checkpoint_state(out: Path) -> dict:
    """trainer_state.json of the checkpoint ``checkpoints/latest`` names: the lineage of weights that survived."""
    root = out / "checkpoints"
    return json.loads((root / (root / "latest").read_text().strip() / "trainer_state.json").read_text())


def exactly_once_problems(pushed: list[PushedGroup], state: dict, num_steps: int, groups_per_step: int) -> list[str]:
    """Every pushed group trained once by the surviving weights, none missing, none extra, none pushed twice."""
    problems = []
    ids = [group.group_id for group in pushed]
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        problems.append(f"group ids pushed more than once: {repeated}")
    expected = num_steps * groups_per_step
    if len(set(ids)) != expected:
        problems.append(f"{len(set(ids))} distinct groups pushed, the run needs {expected}")
    ledger = state["ledger"]
    missing = sorted(set(ids) - set(ledger))
    unknown = sorted(set(ledger) - set(ids))
    if missing:
        problems.append(f"pushed but not in the last checkpoint's ledger (lost): {missing}")
    if unknown:
        problems.append(f"in the ledger but never pushed: {unknown}")
    outcomes = {outcome for outcome in ledger.values()}
    if outcomes - {"trained"}:
        not_trained = {i: o for i, o in ledger.items() if o != "trained"}
        problems.append(f"ledger entries not trained: {not_trained}")
    if state["step"] != num_steps:
        problems.append(f"the last checkpoint is of step {state['step']}, the run has {num_steps}")
    return problems


def staleness_problems(pushed: list[PushedGroup], state: dict, max_staleness: int) -> tuple[list[str], dict[int, int]]:
    """Each trained sample's staleness, v_trainer - its oldest token's version, from the stream's token versions and
    the version each group's step updated (``trained_versions`` of the checkpoint): never above the bound, never
    negative (a token newer than the weights it trains). Returns (problems, samples per staleness)."""
    problems, histogram = [], {}
    trained_versions = state.get("trained_versions", {})
    for group in pushed:
        if state["ledger"].get(group.group_id) != "trained":
            continue
        if group.group_id not in trained_versions:
            problems.append(f"group {group.group_id}: no trained version in the checkpoint")
            continue
        v_trainer = trained_versions[group.group_id]
        for index, (oldest, newest) in enumerate(group.sample_versions):
            staleness = v_trainer - oldest
            histogram[staleness] = histogram.get(staleness, 0) + 1
            if oldest < 0 or staleness > max_staleness or v_trainer - newest < 0:
                problems.append(
                    f"group {group.group_id} sample {index}: token versions {oldest}..{newest} trained by "
                    f"v{v_trainer} (bound {max_staleness})"
                )
    return problems, dict(sorted(histogram.items()))


def time_lost_s(record: FaultRecord, reports: list[MetricsReport]) -> float | None:
    """From the fault until the run made progress again: the first step after the one reported before the fault,
    reported once the fault was over (None: no such step, the run had ended)."""
    after = [
        r.time_s for r in reports if r.step > record.step_before and r.time_s >= max(record.ended_s, record.injected_s)
    ]
    return min(after) - record.injected_s if after else None


def faults_section(
    seed: int, schedule: list[Fault], records: list[FaultRecord], roles: dict, reports: list[MetricsReport]
) -> dict:
    """The summary's ``faults``: what was injected and recovered, by kind; the restarts per role (roles.json); the
    time lost per fault; the median step interval without faults, to read the time lost against."""
    events = [{**record.as_dict(), "time_lost_s": time_lost_s(record, reports)} for record in records]
    lost_by_kind = {
        kind: [e["time_lost_s"] for e in events if e["kind"] == kind and e["time_lost_s"] is not None] for kind in KINDS
    }
    return {
        "seed": seed,
        "scheduled": count_by_kind(schedule),
        "injected": count_by_kind([r.fault for r in records]),
        "recovered": count_by_kind([r.fault for r in records if r.recovered_s]),
        "restarts": {name: report["restarts"] for name, report in roles.items()},
        "expected_restarts": expected_restarts([r.fault for r in records], list(roles)),
        "time_lost_s": {kind: _spread(values) for kind, values in lost_by_kind.items() if values},
        "step_interval_s": _median_step_interval(reports, records),
        "run_end_s": max((r.time_s for r in reports), default=0.0),
        "events": events,
    }


def faults_problems(faults: dict) -> list[str]:
    problems = []
    if faults["injected"] != faults["scheduled"]:
        problems.append(f"injected {faults['injected']}, scheduled {faults['scheduled']}")
    if faults["recovered"] != faults["injected"]:
        problems.append(f"recovered {faults['recovered']} of {faults['injected']}")
    if faults["restarts"] != faults["expected_restarts"]:
        problems.append(f"restarts {faults['restarts']}, the kills explain {faults['expected_restarts']}")
    no_progress = [e for e in faults["events"] if e["time_lost_s"] is None]
    if no_progress:
        problems.append(f"no step made after these faults: {no_progress}")
    never_served = [
        e
        for e in faults["events"]
        if e["kind"] == KILL_ROLLOUT
        and not e["serving_s"]
        and faults["run_end_s"] - e["injected_s"] > SERVING_DEADLINE_S
    ]
    if never_served:
        problems.append(f"rollout servers not serving {SERVING_DEADLINE_S:.0f}s after their kill: {never_served}")
    return problems


def report_rows(faults: dict) -> list[str]:
    """Markdown rows of docs/chaos.md's table: seed | kind | injected | recovered | recovery s (median) | time lost s
    (median, max). Recovery: the launcher restarted the role, Redis answered again; a rollout server's replacement
    serving again where it did before the run ended."""
    rows = []
    for kind in KINDS:
        events = [e for e in faults["events"] if e["kind"] == kind]
        if not events:
            continue
        recovery = [_recovery_s(e) for e in events if _recovery_s(e) is not None]
        lost = faults["time_lost_s"].get(kind, {})
        rows.append(
            f"| {faults['seed']} | {kind} | {len(events)} | {faults['recovered'][kind]} | "
            f"{statistics.median(recovery) if recovery else float('nan'):.1f} | "
            f"{lost.get('median', float('nan')):.1f} | {lost.get('max', float('nan')):.1f} |"
        )
    return rows


def _recovery_s(event: dict) -> float | None:
    done_s = event["serving_s"] if event["kind"] == KILL_ROLLOUT else event["recovered_s"]
    return done_s - event["injected_s"] if done_s else None


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "max": max(values), "all": [round(v, 2) for v in values]}


def _median_step_interval(reports: list[MetricsReport], records: list[FaultRecord]) -> float:
    """Median time between consecutive step reports that no fault fell between (the run's pace without faults)."""
    times = sorted(r.time_s for r in reports)
    fault_times = [r.injected_s for r in records]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False) if not any(a <= t <= b for t in fault_times)]
    return statistics.median(gaps) if gaps else 0.0
