"""The async benchmark's figures, computed from what the roles report on their metrics streams.

Inputs are the trainer's ``MetricsReport`` per step (``step_s``, ``wait_s``, ``reward_mean``, the wall time it was
sent) and the coordinator's periodic reports (about one a second: the cumulative ``rollout_busy_s`` and
``uptime_s``). Per step ``i``, ending at the trainer's report ``i`` and starting at report ``i - 1`` (the first at
the coordinator's start, when admission opens):

- step time: the wall time between those two reports;
- trainer busy: ``step_s - wait_s`` (train, publish, checkpoint: everything but waiting for groups);
- rollout busy: the growth of the coordinator's ``rollout_busy_s`` over the step, interpolated linearly between its
  reports (the seconds the servers had a Generate call of the coordinator open);
- pipeline overlap: step time / max(rollout busy, trainer busy). 1.0: the busier side never waited, a perfect
  pipeline; a synchronous run (generate, then train) sits near (rollout + train) / max(rollout, train).

A run's wall times count from the end of its first ``warmup_steps`` steps (the trainer's report of the last one):
engine start-up is left out alike for every k, and so are the first steps, whose first batches through a fresh
engine and trainer take 5 to 40 times a later step's time on the 2-core machine. At k >= 1 the servers may have
generated later steps' groups during those steps, as they do in steady state: ``groups_ahead_at_start`` says how
many were on the stream, not yet read by the trainer, when the clock started (the trainer's ``queue_depth`` then;
at most k steps' worth).
"""

from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass

REWARD_WINDOW = 5  # steps in the trailing mean that must reach the target, and in the final reward


@dataclass(frozen=True)
class StepFigures:
    step: int
    end_s: float  # seconds from the run's start to the trainer's report of this step
    step_s: float
    trainer_busy_s: float
    rollout_busy_s: float
    overlap: float
    reward: float
    # the trainer's own split of its step (seconds): waiting for groups, training, publishing, checkpointing
    wait_s: float = 0.0
    train_s: float = 0.0
    publish_s: float = 0.0
    checkpoint_s: float = 0.0
    queue_depth: float = 0.0  # groups on the stream not yet read by the trainer when it reported the step


@dataclass(frozen=True)
class RunFigures:
    max_staleness: int
    steps: list[StepFigures]
    clock_start_s: float  # end of the warm-up steps, seconds after the coordinator's start
    groups_ahead_at_start: int  # on the stream, not yet read by the trainer, when the clock started
    wall_to_end_s: float
    wall_to_target_s: float | None  # None: the trailing mean never reached the target
    steps_to_target: int | None
    rollout_busy_fraction: float
    trainer_busy_fraction: float
    median_step_s: float
    median_rollout_s: float
    median_train_s: float
    median_overlap: float
    final_reward: float


def run_start_s(coordinator_reports: list[tuple[float, dict[str, float]]]) -> float:
    """Wall time the coordinator started admitting: its first report's time minus its uptime then."""
    if not coordinator_reports:
        raise ValueError("no coordinator metrics reports: the run's start is unknown")
    time_s, values = coordinator_reports[0]
    return time_s - values["uptime_s"]


def busy_at(points: list[tuple[float, float]], time_s: float) -> float:
    """The cumulative rollout busy seconds at ``time_s``, linear between the reported ``(time, busy)`` points (flat
    after the last one: the coordinator's final report holds its totals)."""
    times = [t for t, _ in points]
    index = bisect.bisect_right(times, time_s)
    if index == 0:
        return points[0][1] if points else 0.0
    if index == len(points):
        return points[-1][1]
    (t0, b0), (t1, b1) = points[index - 1], points[index]
    return b0 + (b1 - b0) * (time_s - t0) / (t1 - t0) if t1 > t0 else b1


def step_figures(
    trainer_reports: list[tuple[int, float, dict[str, float]]],
    coordinator_reports: list[tuple[float, dict[str, float]]],
) -> list[StepFigures]:
    """Per-step figures from the trainer's ``(step, time_s, values)`` and the coordinator's ``(time_s, values)``
    reports; a step reported twice (a retried XADD) counts once, with its last report."""
    start = run_start_s(coordinator_reports)
    busy_points = [(start, 0.0)] + [(t, v["rollout_busy_s"]) for t, v in coordinator_reports if "rollout_busy_s" in v]
    by_step = {step: (time_s, values) for step, time_s, values in trainer_reports}
    figures, previous_end = [], start
    for step in sorted(by_step):
        time_s, values = by_step[step]
        step_s = time_s - previous_end
        trainer_busy = values.get("busy_s", values["step_s"] - values["wait_s"])
        rollout_busy = busy_at(busy_points, time_s) - busy_at(busy_points, previous_end)
        bottleneck = max(trainer_busy, rollout_busy)
        figures.append(
            StepFigures(
                step=step,
                end_s=time_s - start,
                step_s=step_s,
                trainer_busy_s=trainer_busy,
                rollout_busy_s=rollout_busy,
                overlap=step_s / bottleneck if bottleneck > 0 else float("inf"),
                reward=values["reward_mean"],
                wait_s=values["wait_s"],
                train_s=values.get("train_s", 0.0),
                publish_s=values.get("publish_s", 0.0),
                checkpoint_s=values.get("checkpoint_s", 0.0),
                queue_depth=values.get("queue_depth", 0.0),
            )
        )
        previous_end = time_s
    return figures


def first_step_at_target(rewards: list[float], target: float) -> int | None:
    """Index of the first step whose trailing mean over ``REWARD_WINDOW`` steps (fewer at the start) is >= target."""
    for i in range(len(rewards)):
        window = rewards[max(0, i + 1 - REWARD_WINDOW) : i + 1]
        if sum(window) / len(window) >= target:
            return i
    return None


def run_figures(
    max_staleness: int,
    trainer_reports: list[tuple[int, float, dict[str, float]]],
    coordinator_reports: list[tuple[float, dict[str, float]]],
    target: float,
    warmup_steps: int = 1,
) -> RunFigures:
    """One run's figures; wall times and medians count from the end of step ``warmup_steps`` (0: from the start)."""
    steps = step_figures(trainer_reports, coordinator_reports)
    if len(steps) <= warmup_steps:
        raise ValueError(f"{len(steps)} trainer step reports: none after the {warmup_steps} warm-up steps")
    clock = steps[warmup_steps - 1].end_s if warmup_steps else 0.0
    measured = steps[warmup_steps:]
    wall = steps[-1].end_s - clock
    at_target = first_step_at_target([s.reward for s in steps], target)
    return RunFigures(
        max_staleness=max_staleness,
        steps=steps,
        clock_start_s=clock,
        groups_ahead_at_start=int(steps[warmup_steps - 1].queue_depth) if warmup_steps else 0,
        wall_to_end_s=wall,
        wall_to_target_s=None if at_target is None else max(0.0, steps[at_target].end_s - clock),
        steps_to_target=None if at_target is None else steps[at_target].step,
        rollout_busy_fraction=sum(s.rollout_busy_s for s in measured) / wall,
        trainer_busy_fraction=sum(s.trainer_busy_s for s in measured) / wall,
        median_step_s=statistics.median(s.step_s for s in measured),
        median_rollout_s=statistics.median(s.rollout_busy_s for s in measured),
        median_train_s=statistics.median(s.trainer_busy_s for s in measured),
        median_overlap=statistics.median(s.overlap for s in measured),
        final_reward=statistics.fmean(s.reward for s in steps[-REWARD_WINDOW:]),
    )


def speedups(runs: list[RunFigures]) -> dict:
    """Every k against the synchronous runs (max_staleness 0): wall time to the target and to the end, median step
    time; plus each k's pipeline overlap and final reward. With several runs of a k (rounds) each figure is the
    median over them; a time missing from half or more of them (the target never reached) makes its ratio None."""
    by_k: dict[int, list[RunFigures]] = {}
    for run in runs:
        by_k.setdefault(run.max_staleness, []).append(run)
    if 0 not in by_k:
        raise ValueError("speed-ups need the synchronous run (max_staleness 0) among the runs")

    def median(k: int, field: str) -> float | None:
        values = [getattr(run, field) for run in by_k[k] if getattr(run, field) is not None]
        return statistics.median(values) if len(values) * 2 > len(by_k[k]) else None

    def ratio(k: int, field: str) -> float | None:
        base, value = median(0, field), median(k, field)
        return None if base is None or not value else round(base / value, 3)

    return {
        "speedup_to_target": {str(k): ratio(k, "wall_to_target_s") for k in by_k},
        "speedup_to_end": {str(k): ratio(k, "wall_to_end_s") for k in by_k},
        "speedup_step": {str(k): ratio(k, "median_step_s") for k in by_k},
        "overlap": {str(k): round(median(k, "median_overlap"), 3) for k in by_k},
        "final_reward": {str(k): round(median(k, "final_reward"), 4) for k in by_k},
        "runs_per_k": {str(k): len(by_k[k]) for k in by_k},
    }
