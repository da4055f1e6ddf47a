"""Evaluation rounds, each pinned to one policy version.

Every eval request goes only to a server whose reported version equals the pinned version v, and
every returned sample must carry version spans of v alone; a response that does not (the server
moved on mid-request) is discarded and asked for again. So all samples of a round come from exactly
v. The scheduler holds training admission at v while the round runs (see ``scheduler``), which keeps
the fleet on v. Results per dataset label: ``eval/<label>/acc`` (mean correctness, a sample is correct
when its reward is >= 1) and ``eval/<label>/pass@<k>`` (share of problems with a correct sample). The label is
``coordinator.eval.labels[path]``, else the rows' ``data_source``, else the file stem (``eval_label``). Every
sample of a round (problem, response, reward, correctness) is dumped as JSONL under the run's export path.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from coordinator.fleet import Fleet, NoServerAvailable
from coordinator.rollout_client import RolloutFailed, SampleResult
from coordinator.tasks import PromptRenderer, ResponseScorer, load_problems
from protos.config import CoordinatorConfig, EvalConfig, RunConfig, SamplingConfig

logger = logging.getLogger(__name__)

MAX_CONCURRENT_REQUESTS = 32


class EvalIncomplete(RuntimeError):
    """A round could not collect every sample at its pinned version."""


@dataclass
class EvalProblem:
    problem: object  # coordinator.datasets.Problem
    prompt_token_ids: list[int]


@dataclass
class EvalSet:
    name: str
    problems: list[EvalProblem]
    num_too_long: int


def spans_match(result: SampleResult, version: int) -> bool:
    """True when every token of the sample was produced by policy ``version``."""
    return all(span_version == version for span_version, _start, _end in result.version_spans)


def pass_at_k(correct_by_problem: list[list[bool]]) -> tuple[float, float]:
    """(mean accuracy over samples, share of problems with at least one correct sample)."""
    flat = [c for problem in correct_by_problem for c in problem]
    acc = sum(flat) / max(1, len(flat))
    solved = sum(any(problem) for problem in correct_by_problem) / max(1, len(correct_by_problem))
    return acc, solved


def eval_versions(
    config: EvalConfig,
    start_version: int,
    num_steps: int,
    steps_done: int = 0,
    evaluated: frozenset[int] | set[int] = frozenset(),
) -> list[int]:
    """Versions to evaluate: after every ``interval_steps`` trainer steps of the run (and before its first, if asked).

    A coordinator restarted when the trainer had taken ``steps_done`` steps (at ``start_version``) keeps the run's
    schedule: the rounds still ahead, each at the version its step will have, and the current one unless an
    earlier coordinator reported it (``evaluated``).
    """
    if not config.datasets:
        return []
    steps = [0] if config.at_start else []
    if config.interval_steps:
        steps += list(range(config.interval_steps, num_steps + 1, config.interval_steps))
    versions = [start_version + step - steps_done for step in steps if step >= steps_done]
    return [version for version in versions if version not in evaluated]


def eval_label(path: str, problems: list, labels: dict[str, str]) -> str:
    """The metric label of an eval file: the configured one, else its rows' one ``data_source`` (the loader gives
    rows without one the file stem), else the file stem (rows of several sources)."""
    if path in labels:
        return labels[path]
    sources = {problem.data_source for problem in problems}
    return sources.pop() if len(sources) == 1 else Path(path).stem


def load_eval_sets(config: CoordinatorConfig, renderer: PromptRenderer, max_model_len: int) -> list[EvalSet]:
    """Load and render every eval file; prompts that cannot fit the model length are left out (counted)."""
    sampling = config.eval.sampling or config.sampling
    limit = max_model_len - sampling.max_tokens
    sets = []
    for path in config.eval.datasets:
        problems = load_problems(path, config, config.eval.limit)
        rendered = [EvalProblem(p, renderer.render(p.messages)) for p in problems]
        fitting = [p for p in rendered if len(p.prompt_token_ids) <= limit]
        if not fitting:
            raise ValueError(
                f"coordinator.eval.datasets: no problem of {path} fits in {limit} prompt tokens "
                f"(rollout.max_model_len {max_model_len} - eval max_tokens {sampling.max_tokens})"
            )
        sets.append(EvalSet(eval_label(path, problems, config.eval.labels), fitting, len(rendered) - len(fitting)))
        logger.info(
            "eval set %s: %d problems (%d too long, left out)", sets[-1].name, len(fitting), sets[-1].num_too_long
        )
    return sets


class EvalRunner:
    """Runs eval rounds over ``sets`` on the fleet; one round at a time, each pinned to a version."""

    def __init__(self, run: RunConfig, fleet: Fleet, sets: list[EvalSet], scorer: ResponseScorer, dump_dir: str = ""):
        self.run, self.config = run, run.coordinator
        self.fleet = fleet
        self.sets = sets
        self.scorer = scorer
        self.dump_dir = Path(dump_dir) if dump_dir else None
        self.latest: dict[str, float] = {}
        self.latest_version = -1
        self.samples_discarded = 0
        self.rounds_done = 0
        self.rounds_failed = 0
        self.rounds_skipped = 0
        self.pending: list[int] = []
        self._progress = (-1, time.monotonic())  # (trainer version, when it last changed or work was in flight)

    def schedule(self, versions: list[int]) -> None:
        self.pending = sorted(set(versions))

    def shift(self, versions: int) -> None:
        """The trainer's version - steps changed by ``versions`` (``Scheduler.set_version_offset``): the rounds due
        after N steps come that many versions later (or earlier)."""
        self.pending = [version + versions for version in self.pending]

    def due(self, scheduler, now_s: float | None = None) -> int | None:
        """Hold the scheduler's admission at the next pending version; return it once the trainer is there.

        Call only while no round runs. A version the trainer has already passed cannot be evaluated
        pinned (the fleet has moved on), and one the trainer does not reach while nothing is left for
        it to train (for ``eval.timeout_s``) is given up: both are skipped with a warning and counted.
        ``now_s`` is the monotonic time (tests pass their own clock).
        """
        now = time.monotonic() if now_s is None else now_s
        if scheduler.trainer_version != self._progress[0] or not self._waiting_on_trainer(scheduler):
            self._progress = (scheduler.trainer_version, now)
        while self.pending and (
            scheduler.trainer_version > self.pending[0] or now - self._progress[1] > self.config.eval.timeout_s
        ):
            logger.warning(
                "eval at v%d skipped: the trainer is at v%d (no progress for %.0fs)",
                self.pending[0],
                scheduler.trainer_version,
                now - self._progress[1],
            )
            self.pending.pop(0)
            self.rounds_skipped += 1
            self._progress = (scheduler.trainer_version, now)
        scheduler.eval_hold_version = self.pending[0] if self.pending else None
        if self.pending and scheduler.trainer_version == self.pending[0]:
            return self.pending.pop(0)
        return None

    def _waiting_on_trainer(self, scheduler) -> bool:
        """Every slot before the next eval version is pushed: only the trainer can move the run on."""
        if not self.pending:
            return False
        hold_slots = scheduler.slots_before(self.pending[0])
        return not scheduler.in_flight and scheduler.stats.slots_admitted >= min(hold_slots, scheduler.total_groups)

    @property
    def sampling(self) -> SamplingConfig:
        return self.run.eval_sampling()

    async def run_round(self, version: int) -> dict[str, float] | None:
        """Evaluate every set at ``version``; returns the metrics, or None if the round could not finish."""
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.config.eval.timeout_s):
                values = {}
                for eval_set in self.sets:
                    values.update(await self._run_set(eval_set, version))
        except (TimeoutError, NoServerAvailable, RolloutFailed, EvalIncomplete) as error:
            self.rounds_failed += 1
            logger.warning(
                "eval round at v%d abandoned after %.0fs: %s",
                version,
                time.monotonic() - started,
                error or type(error).__name__,
            )
            return None
        values["eval/duration_s"] = time.monotonic() - started
        self.latest, self.latest_version = values, version
        self.rounds_done += 1
        logger.info("eval at v%d: %s", version, {k: round(v, 4) for k, v in values.items()})
        return values

    async def _run_set(self, eval_set: EvalSet, version: int) -> dict[str, float]:
        k = self.config.eval.samples_per_problem
        gate = asyncio.Semaphore(MAX_CONCURRENT_REQUESTS)

        async def one(item: EvalProblem) -> list[dict]:
            async with gate:
                return await self._sample_problem(eval_set.name, item, version, k)

        rows_by_problem = await asyncio.gather(*(one(item) for item in eval_set.problems))
        acc, solved = pass_at_k([[row["correct"] for row in rows] for rows in rows_by_problem])
        self._write_rows(version, [row for rows in rows_by_problem for row in rows])
        prefix = f"eval/{eval_set.name}"
        return {
            f"{prefix}/acc": acc,
            f"{prefix}/pass@{k}": solved,
            f"{prefix}/num_problems": float(len(eval_set.problems)),
            f"{prefix}/num_too_long": float(eval_set.num_too_long),
        }

    async def _sample_problem(self, name: str, item: EvalProblem, version: int, k: int) -> list[dict]:
        """k samples of one problem, all from ``version``; off-version responses are asked for again."""
        for _ in range(self.config.max_attempts):
            results, client = await self.fleet.generate(
                item.prompt_token_ids,
                k,
                self.sampling,
                accept=lambda c: c.policy_version == version,
                what=f"at exactly policy version {version} (eval)",
                request_id=f"eval-v{version}-{uuid.uuid4().hex[:6]}",
                timeout_s=self.config.request_timeout_s,
                max_attempts=self.config.max_attempts,
            )
            if all(spans_match(r, version) for r in results):
                break
            self.samples_discarded += len(results)
            logger.warning(
                "eval %s/%s: response from %s spans versions %s, not only v%d; discarded",
                name,
                item.problem.problem_id,
                client.address,
                [r.version_spans for r in results],
                version,
            )
        else:
            raise EvalIncomplete(
                f"{name}/{item.problem.problem_id}: no response at exactly v{version} "
                f"in {self.config.max_attempts} tries"
            )
        scores = await self.scorer.score(item.problem, [r.token_ids for r in results])
        texts = self.scorer.tokenizer.batch_decode([r.token_ids for r in results], skip_special_tokens=True)
        return [
            {
                "dataset": name,
                "problem_id": item.problem.problem_id,
                "version": version,
                "server": client.address,
                "version_spans": r.version_spans,
                "reward": s.reward,
                "correct": s.reward >= 1.0,
                "error": s.error,
                "response": text,
            }
            for r, s, text in zip(results, scores, texts, strict=True)
        ]

    def _write_rows(self, version: int, rows: list[dict]) -> None:
        """Every eval sample goes to ``<dump_dir>/eval/v<version>.jsonl`` (the run's export path; '' = none)."""
        if self.dump_dir is None:
            return
        path = self.dump_dir / "eval" / f"v{version}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as handle:
            for row in rows:
                handle.write(json.dumps(row) + "\n")
