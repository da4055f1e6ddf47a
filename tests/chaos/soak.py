"""One chaos soak from start to audit: ``run_soak`` (what the tests call) and, for runs by hand,

    .venv/bin/python -m tests.chaos.soak --seed 7 [--long] [--workdir DIR]

which prints the report rows of docs/chaos.md and, last, one JSON object: the seed, the faults section and the
problems found (none: the soak passed). It builds the tiny model without warm-up (the soak checks bookkeeping, not
learning) once per work directory.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.chaos import audit
from tests.chaos.harness import GROUPS_PER_STEP, MAX_STALENESS, NUM_ROLLOUT_SERVERS, ChaosRun
from tests.chaos.schedule import (
    CONNECTION_CUT,
    KILL_COORDINATOR,
    KILL_ROLLOUT,
    KILL_TRAINER,
    REDIS_RESTART,
    SoakSize,
    make_schedule,
)

# CI size: one fault of each kind and a second cut, over a short run (a few minutes on a 2-core machine)
CI_SIZE = SoakSize(
    num_steps=40,
    faults_per_kind={KILL_ROLLOUT: 1, KILL_TRAINER: 1, KILL_COORDINATOR: 1, REDIS_RESTART: 1, CONNECTION_CUT: 2},
)
# FLEETRL_CHAOS_LONG=1 / --long: three of each kind over a longer run
LONG_SIZE = SoakSize(
    num_steps=80,
    faults_per_kind={KILL_ROLLOUT: 3, KILL_TRAINER: 3, KILL_COORDINATOR: 3, REDIS_RESTART: 3, CONNECTION_CUT: 3},
)


@dataclass
class SoakResult:
    exit_code: int
    summary: dict  # the launcher's summary.json, with the soak's ``faults`` section added
    problems: list[str]
    survivors: list[str]  # processes of the run alive after it ended
    rows: list[str]  # docs/chaos.md's table rows


def run_soak(workdir: Path, model_dir: str, size: SoakSize, seed: int, finish_timeout_s: float = 900.0) -> SoakResult:
    """Run ``fleetrl demo`` under the seeded schedule, then audit what it left (see audit.py)."""
    schedule = make_schedule(seed, size, NUM_ROLLOUT_SERVERS)
    run = ChaosRun(workdir, model_dir, size, seed)
    try:
        run.start()
        run.inject(schedule)
        exit_code = run.finish(finish_timeout_s)
        return _audit(run, schedule, exit_code)
    finally:
        run.close()


def _audit(run: ChaosRun, schedule, exit_code: int) -> SoakResult:
    """Everything is read before valkey stops (``run.close``); survivors are looked for once the launcher exited."""
    problems = [] if exit_code == 0 else [f"fleetrl demo exited with {exit_code}:\n{run.text()}"]
    summary_path = run.out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    pushed = audit.read_pushed(run.direct, run.keys)
    reports = audit.trainer_reports(run.direct, run.keys)
    state = audit.latest_checkpoint_state(run.out)
    problems += audit.exactly_once_problems(pushed, state, run.size.num_steps, GROUPS_PER_STEP)
    stale, histogram = audit.staleness_problems(pushed, state, MAX_STALENESS)
    problems += stale
    faults = audit.faults_section(run.seed, schedule, run.records, run.roles(), reports)
    faults["sample_staleness"] = histogram
    problems += audit.faults_problems(faults)
    if summary and summary.get("steps") != run.size.num_steps:
        problems.append(f"the summary counts {summary.get('steps')} steps, the run has {run.size.num_steps}")
    survivors = run.watch.survivors()
    if survivors:
        problems.append(f"processes left behind: {survivors}")
    summary["faults"] = faults
    summary_path.write_text(json.dumps(summary, indent=2))
    return SoakResult(exit_code, summary, problems, survivors, audit.report_rows(faults))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.soak", description=__doc__)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--long", action="store_true", help="the long soak (LONG_SIZE) instead of the CI size")
    parser.add_argument("--workdir", default="", help="keep the run here (default: a temp dir, removed)")
    args = parser.parse_args(argv)
    from modeling.tiny_model import init_tiny

    with tempfile.TemporaryDirectory(prefix="fleetrl-chaos-") as scratch:
        workdir = Path(args.workdir or scratch)
        model = workdir / "model"
        if not (model / "config.json").exists():
            init_tiny(model)
        result = run_soak(workdir / f"seed-{args.seed}", str(model), LONG_SIZE if args.long else CI_SIZE, args.seed)
    print("\n".join(result.rows))
    print(json.dumps({"seed": args.seed, "faults": result.summary["faults"], "problems": result.problems}))
    return 0 if not result.problems else 1


if __name__ == "__main__":
    sys.exit(main())
