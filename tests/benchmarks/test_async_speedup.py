"""benchmarks/async_speedup.py's figures from recorded metrics reports (the trainer's per step, the coordinator's
about once a second), and its plot: the computed fields, not timings."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from async_speedup import bind_threads, parse_args, plot, side_of  # noqa: E402
from pipeline_figures import busy_at, first_step_at_target, run_figures, speedups, step_figures  # noqa: E402

pytestmark = pytest.mark.unit

START = 1000.0  # wall time the coordinator started (its first report minus its uptime)


def coordinator_reports(busy_by_time: dict[float, float]) -> list[tuple[float, dict[str, float]]]:
    """Periodic reports at START + t holding the cumulative rollout busy seconds at that time."""
    return [(START + t, {"uptime_s": t, "rollout_busy_s": busy}) for t, busy in sorted(busy_by_time.items())]


def trainer_report(step: int, end: float, step_s: float, wait_s: float, reward: float, queued: int = 0):
    values = {"step_s": step_s, "wait_s": wait_s, "reward_mean": reward, "train_s": step_s - wait_s - 0.1}
    return (step, START + end, {**values, "publish_s": 0.05, "checkpoint_s": 0.05, "queue_depth": float(queued)})


def synchronous_run(step_s: float = 3.0) -> tuple[list, list]:
    """Generate 2/3 of a step, then train 1/3 (k = 0): the servers are busy 2 s of every 3 (at ``step_s`` 3)."""
    busy = {0.5: 0.5} | {step_s * i - step_s / 3: 2 * step_s / 3 * i for i in (1, 2, 3, 4)}
    busy |= {step_s * i: 2 * step_s / 3 * i for i in (1, 2, 3, 4)}
    trainer = [trainer_report(i, step_s * i, step_s, 2 * step_s / 3, 0.2 * i) for i in (1, 2, 3, 4)]
    return trainer, coordinator_reports(busy)


def pipelined_run() -> tuple[list, list]:
    """The servers always busy, the next step's 4 groups ready when a step ends, the trainer busy 1 s of every 2-s
    step (k >= 1): a perfect pipeline."""
    busy = {float(t): float(t) for t in range(0, 9)}
    trainer = [trainer_report(i, 2.0 * i, 2.0, 1.0, 0.2 * i, queued=4) for i in (1, 2, 3, 4)]
    return trainer, coordinator_reports(busy)


def test_step_figures_split_each_step_between_rollout_and_trainer_and_compute_the_overlap():
    steps = step_figures(*synchronous_run())
    assert [s.step for s in steps] == [1, 2, 3, 4]
    assert [s.end_s for s in steps] == [3.0, 6.0, 9.0, 12.0]
    assert [s.step_s for s in steps] == [3.0] * 4
    assert [s.trainer_busy_s for s in steps] == [1.0] * 4  # step_s - wait_s
    assert [s.rollout_busy_s for s in steps] == pytest.approx([2.0] * 4)
    assert [s.overlap for s in steps] == pytest.approx([1.5] * 4)  # (2 + 1) / max(2, 1)
    assert steps[0].publish_s == 0.05 and steps[0].train_s == pytest.approx(0.9)
    assert [s.overlap for s in step_figures(*pipelined_run())] == pytest.approx([1.0] * 4)


def test_rollout_busy_is_interpolated_between_reports_and_flat_after_the_last():
    points = [(0.0, 0.0), (2.0, 1.0), (4.0, 3.0)]
    assert busy_at(points, 1.0) == 0.5
    assert busy_at(points, 3.0) == 2.0
    assert busy_at(points, 9.0) == 3.0  # the coordinator's final report holds its totals
    assert busy_at(points, -1.0) == 0.0


def test_a_step_reported_twice_counts_once_with_its_last_report():
    trainer, coordinator = synchronous_run()
    again = trainer_report(2, 6.0, 3.0, 2.5, 0.9)  # a retried XADD landed twice
    steps = step_figures([*trainer[:2], again, *trainer[2:]], coordinator)
    assert [s.step for s in steps] == [1, 2, 3, 4] and steps[1].reward == 0.9


def test_the_target_is_reached_by_the_trailing_mean_of_five_steps():
    assert first_step_at_target([0.1, 0.9, 0.1, 0.1, 0.1, 0.1], 0.5) == 1  # the mean of the first two is 0.5
    assert first_step_at_target([0.1] * 5 + [0.9] * 5, 0.5) == 7  # (0.1 * 2 + 0.9 * 3) / 5 = 0.58
    assert first_step_at_target([0.1] * 10, 0.5) is None


def test_run_figures_count_from_the_end_of_the_warmup_and_speedups_compare_with_the_synchronous_run():
    sync = run_figures(0, *synchronous_run(), target=0.4, warmup_steps=1)
    piped = run_figures(2, *pipelined_run(), target=0.4, warmup_steps=1)
    assert sync.clock_start_s == 3.0 and piped.clock_start_s == 2.0  # the end of step 1
    assert sync.groups_ahead_at_start == 0 and piped.groups_ahead_at_start == 4  # step 2's groups ready already
    assert sync.wall_to_end_s == 9.0 and piped.wall_to_end_s == 6.0
    assert sync.steps_to_target == piped.steps_to_target == 3  # rewards 0.2, 0.4, 0.6: trailing means 0.2, 0.3, 0.4
    assert sync.wall_to_target_s == 6.0 and piped.wall_to_target_s == 4.0
    assert sync.rollout_busy_fraction == pytest.approx(6.0 / 9.0)
    assert sync.trainer_busy_fraction == pytest.approx(3.0 / 9.0)
    assert piped.rollout_busy_fraction == pytest.approx(1.0)
    assert sync.median_overlap == pytest.approx(1.5) and piped.median_overlap == pytest.approx(1.0)
    assert sync.final_reward == pytest.approx(0.5)  # the mean of the (only four) steps
    figures = speedups([sync, piped])
    assert figures["speedup_to_target"] == {"0": 1.0, "2": 1.5}
    assert figures["speedup_to_end"] == {"0": 1.0, "2": 1.5}
    assert figures["speedup_step"] == {"0": 1.0, "2": 1.5}
    assert figures["overlap"] == {"0": 1.5, "2": 1.0}
    assert figures["final_reward"] == {"0": 0.5, "2": 0.5}
    from_start = run_figures(0, *synchronous_run(), target=0.4, warmup_steps=0)
    assert from_start.clock_start_s == 0.0 and from_start.wall_to_end_s == 12.0
    assert from_start.groups_ahead_at_start == 0


def test_several_rounds_of_a_k_give_medians():
    syncs = [run_figures(0, *synchronous_run(step_s), target=0.4) for step_s in (3.0, 3.0, 6.0)]
    piped = run_figures(2, *pipelined_run(), target=0.4)
    figures = speedups([*syncs, piped])
    assert figures["runs_per_k"] == {"0": 3, "2": 1}
    assert figures["speedup_to_end"]["2"] == 1.5  # the median synchronous run (9 s), not the mean (12 s)
    assert figures["speedup_step"]["2"] == 1.5


def test_a_run_that_never_reaches_the_target_has_no_speedup_and_k0_is_required():
    never = run_figures(1, *pipelined_run(), target=0.9)
    assert never.wall_to_target_s is None and never.steps_to_target is None
    sync = run_figures(0, *synchronous_run(), target=0.4)
    assert speedups([sync, never])["speedup_to_target"]["1"] is None
    with pytest.raises(ValueError, match="synchronous run"):
        speedups([never])
    with pytest.raises(ValueError, match="no coordinator metrics"):
        step_figures(synchronous_run()[0], [])
    with pytest.raises(ValueError, match="warm-up"):
        run_figures(0, synchronous_run()[0][:1], synchronous_run()[1], target=0.4, warmup_steps=1)


def test_roles_are_bound_by_their_side_and_the_plot_is_written(tmp_path):
    assert side_of("python -m rollout_service serve --port 0") == "rollout"
    assert side_of("python -m coordinator run --servers a") == "rollout"
    assert side_of("valkey-server --port 1") == "rollout"
    assert side_of("python -m trainer_service train --config c") == "trainer"
    assert side_of("python -c pass") == ""
    args = parse_args(["--staleness", "2,0,1", "num_steps=5"])
    assert args.staleness == [0, 1, 2] and args.overrides == ["num_steps=5"]
    for bad in ("1,2", "x", "-1,0"):  # no synchronous run to compare with; not numbers; negative
        with pytest.raises(SystemExit):
            parse_args(["--staleness", bad])
    path = tmp_path / "images" / "plot.png"
    plot([run_figures(0, *synchronous_run(), 0.5), run_figures(2, *pipelined_run(), 0.5)], 0.5, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_threads_are_bound_to_their_cores_and_a_process_gone_meanwhile_raises_what_the_pinner_skips(tmp_path):
    import os
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
    try:
        bind_threads(child.pid, {0})
        assert os.sched_getaffinity(child.pid) == {0}
    finally:
        child.kill()
        child.wait()
    with pytest.raises(FileNotFoundError):  # RolePinner skips it (an OSError), and keeps binding the others
        bind_threads(child.pid, {0})
