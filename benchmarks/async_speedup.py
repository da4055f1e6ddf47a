#!/usr/bin/env python
"""Asynchronous vs synchronous RL: the same run at max staleness 0, 1, 2 and 4, side by side, in one invocation.

Run from the repository root (CPU; the tiny model is built and cached on first use)::

    .venv/bin/python benchmarks/async_speedup.py [--staleness 0,1,2,4] [--target 0.5] [dotted.key=value ...]

Each k runs the whole system as ``fleetrl demo`` does (``launcher.demo.run_demo``: every role its own
process, vLLM CPU engine, torch trainer, tcp weight bus) on ``recipes/bench-async.yaml`` (the demo's echo task at a
size where one step's rollout and training cost about the same here), with the same seeds, model and batch; only
``max_staleness`` differs. The runs go one after another. Each gets its own embedded valkey, which outlives the run
so that its metrics streams can be read afterwards (``pipeline_figures`` says what is computed from them).

Cores: with ``--rollout-cpus 0 --trainer-cpus 1`` (the default on a machine of 2+ cores) every thread of the rollout
server, its engine, the coordinator and valkey is bound to core 0 and the trainer's to core 1, so that generating
and training each own one core whatever k is: k = 0 leaves one of them idle at a time, k >= 1 can keep both busy.

Wall times count from the end of the first ``--warmup-steps`` steps (default 1: a fresh engine's and trainer's first
batches take many times a later step here; ``pipeline_figures`` says what that leaves out). Prints a table per k
(with the machine's load average around each run), writes ``<out>/k<k>/figures.json`` and a plot of reward vs wall
time for every k (``--plot``), and ends with one JSON line: the speed-ups against k = 0 (to the reward target, to the
end, per step), the median pipeline overlap, the final reward and the load of every k.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from pipeline_figures import RunFigures, run_figures, speedups  # noqa: E402

ROLE_MARKERS = {
    "rollout_service": "rollout",
    "coordinator": "rollout",
    "valkey": "rollout",
    "trainer_service": "trainer",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--staleness", type=k_list, default=[0, 1, 2, 4], help="the k of the runs, e.g. 0,1,2,4")
    parser.add_argument("--target", type=float, default=0.5, help="reward target (trailing mean of 5 steps)")
    parser.add_argument("--warmup-steps", type=int, default=1, help="steps before the clock starts (see below)")
    parser.add_argument("--rounds", type=int, default=1, help="run every k this many times, interleaved; medians")
    parser.add_argument("--config", action="append", default=None, help="recipe(s); default recipes/bench-async.yaml")
    parser.add_argument("--out", default=f"runs/async-speedup-{time.strftime('%Y%m%d-%H%M%S')}")
    parser.add_argument("--plot", default=str(REPO / "docs" / "images" / "async_speedup.png"))
    parser.add_argument("--rollout-cpus", default="0", help="cores of the rollout side; '' = no binding")
    parser.add_argument("--trainer-cpus", default="1", help="cores of the trainer; '' = no binding")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides for every run, e.g. num_steps=10")
    args = parser.parse_args(argv)
    if 0 not in args.staleness:
        parser.error("--staleness must include 0: the speed-ups are against the synchronous run")
    return args


def k_list(text: str) -> list[int]:
    values = sorted({int(part) for part in text.split(",") if part.strip()})
    if not values or values[0] < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated max_staleness values >= 0, e.g. 0,1,2,4")
    return values


def cpu_set(text: str) -> set[int] | None:
    return {int(part) for part in text.split(",") if part.strip()} or None


class RolePinner:
    """Binds every thread of the launcher's role processes (and their children: vLLM's engine core) to the cores of
    their side, re-scanning twice a second so that threads and processes started later are bound too."""

    def __init__(self, cpus_by_side: dict[str, set[int] | None]):
        self.cpus_by_side = cpus_by_side
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="role-pinner", daemon=True)

    def __enter__(self) -> RolePinner:
        if any(self.cpus_by_side.values()):
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=5)

    def _run(self) -> None:
        import psutil

        me = psutil.Process()
        while not self.stop.wait(0.5):
            for child in me.children():  # the launcher's role processes (and valkey)
                try:
                    cpus = self.cpus_by_side.get(side_of(" ".join(child.cmdline())))
                    if cpus:
                        for process in [child, *child.children(recursive=True)]:
                            bind_threads(process.pid, cpus)
                except (psutil.Error, OSError):
                    continue  # it exited meanwhile (its /proc entry went away)


def side_of(cmdline: str) -> str:
    return next((side for marker, side in ROLE_MARKERS.items() if marker in cmdline), "")


def bind_threads(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` onto ``cpus``; raises FileNotFoundError when the process is gone."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            if os.sched_getaffinity(int(tid)) != cpus:
                os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):
            continue  # the thread ended meanwhile


def run_once(k: int, args: argparse.Namespace, round_index: int = 0) -> tuple[RunFigures, tuple[float, float]]:
    """One whole run at max_staleness ``k``: its own valkey, the launcher's run, then its metrics streams read.
    Returns its figures and the machine's 1-minute load average before and after it."""
    import redis

    from launcher.demo import run_demo
    from launcher.redis_server import EmbeddedRedis
    from protos.config import load_run_config

    out_dir = Path(args.out) / (f"k{k}" if args.rounds == 1 else f"round{round_index}-k{k}")
    recipes = args.config or [str(REPO / "recipes" / "bench-async.yaml")]
    pins = {"rollout": cpu_set(args.rollout_cpus), "trainer": cpu_set(args.trainer_cpus)}
    with EmbeddedRedis(appendonly=False) as server, RolePinner(pins):
        overrides = [*args.overrides, f"max_staleness={k}", f"redis_url={server.url}", f"run_id=bench-k{k}"]
        config = load_run_config(recipes, [*overrides, "coordinator.admin_port=0"])
        print(f"--- max_staleness {k}: run dir {out_dir}", flush=True)
        load = os.getloadavg()[0]
        run_demo(config, out_dir)
        load = (load, os.getloadavg()[0])
        client = redis.Redis.from_url(server.url)
        trainer, coordinator = read_reports(client, config.run_id)
    figures = run_figures(k, trainer, coordinator, args.target, args.warmup_steps)
    (out_dir / "figures.json").write_text(json.dumps({**dataclasses.asdict(figures), "load_avg_1m": load}, indent=2))
    return figures, load


def read_reports(client, run_id: str) -> tuple[list, list]:
    """The trainer's ``(step, time_s, values)`` and the coordinator's periodic ``(time_s, values)`` reports."""
    from protos.records import decode_metrics
    from protos.redis_keys import RedisKeys

    keys = RedisKeys(run_id)

    def reports(role: str):
        entries = client.xrange(keys.metrics(role))
        return [decode_metrics(fields[b"m"]) for _, fields in entries if b"m" in fields]

    trainer = [(r.step, r.time_s, dict(r.values)) for r in reports("trainer")]
    coordinator = [(r.time_s, dict(r.values)) for r in reports("coordinator") if "eval/version" not in r.values]
    return trainer, coordinator


def print_table(runs: list[RunFigures], loads: list[tuple[float, float]], args: argparse.Namespace) -> None:
    print(
        f"reward target {args.target} (trailing mean of 5 steps); wall times and medians count from the end of step "
        f"{args.warmup_steps}; ahead = groups on the stream not yet read by the trainer then; load = 1-minute load "
        "average before-after the run; speed-ups: medians over rounds"
    )
    print(
        f"{'k':>2} {'to target s':>11} {'steps':>5} {'to end s':>8} {'step s':>6} {'rollout s':>9} {'train s':>7} "
        f"{'overlap':>7} {'rollout busy':>12} {'trainer busy':>12} {'final reward':>12} {'ahead':>5} {'load':>9}"
    )
    for r, (before, after) in zip(runs, loads, strict=True):
        to_target = "-" if r.wall_to_target_s is None else f"{r.wall_to_target_s:.1f}"
        ahead = r.groups_ahead_at_start
        print(
            f"{r.max_staleness:>2} {to_target:>11} {r.steps_to_target or '-':>5} {r.wall_to_end_s:>8.1f} "
            f"{r.median_step_s:>6.2f} {r.median_rollout_s:>9.2f} {r.median_train_s:>7.2f} {r.median_overlap:>7.2f} "
            f"{r.rollout_busy_fraction:>12.2f} {r.trainer_busy_fraction:>12.2f} {r.final_reward:>12.3f} {ahead:>5} "
            f"{before:>4.1f}-{after:<4.1f}"
        )


def plot(runs: list[RunFigures], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4.5))
    colors: dict[int, str] = {}
    for run in runs:  # a k's later rounds in its colour, unlabelled
        k = run.max_staleness
        label = None if k in colors else "k = 0 (synchronous)" if k == 0 else f"k = {k}"
        times = [s.end_s - run.clock_start_s for s in run.steps]
        (line,) = axes.plot(times, [s.reward for s in run.steps], marker=".", label=label, color=colors.get(k))
        colors.setdefault(k, line.get_color())
    axes.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target}")
    axes.axvline(0.0, color="grey", linewidth=0.5)
    axes.set_xlabel("wall time since the clock started, after the warm-up steps (s)")
    axes.set_ylabel("mean reward of the step's batch")
    axes.set_title("fleetrl echo task on CPU: reward vs wall time per max staleness k")
    axes.grid(alpha=0.3)
    axes.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if (os.cpu_count() or 1) < 2:
        args.rollout_cpus = args.trainer_cpus = ""  # one core: nothing to split
    # rounds alternate the order of k, so that a slow spell of the machine does not always fall on the same k
    order = [(i, k) for i in range(args.rounds) for k in (args.staleness if i % 2 == 0 else args.staleness[::-1])]
    results = [run_once(k, args, i) for i, k in order]
    runs, loads = [figures for figures, _ in results], [load for _, load in results]
    print_table(runs, loads, args)
    plot(runs, args.target, Path(args.plot))
    print(f"plot: {args.plot}", flush=True)
    load_avg: dict[str, list] = {}
    for run, load in zip(runs, loads, strict=True):
        load_avg.setdefault(str(run.max_staleness), []).append([round(x, 1) for x in load])
    print(json.dumps({"target": args.target, **speedups(runs), "load_avg_1m": load_avg}))


if __name__ == "__main__":
    main()
