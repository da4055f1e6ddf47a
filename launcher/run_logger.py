"""The run logger: a run's step and eval figures on the console or in a Weights & Biases run (``logger.backend``).

It is fed from the run's metrics streams: ``read_reports`` follows the trainer's and the coordinator's streams through
the typed metrics channel (``channels.metrics_stream``), the launcher hands each report to ``RunLogger``. Names in the Weights & Biases run:

- the guide's figures: ``reward`` (mean training reward of the step), ``loss``, ``staleness`` (max over the step's
  groups), ``abs_logprob_diff`` (mean |trainer - rollout| logprob of the trained tokens, |dlogp|),
  ``throughput/rollout_tokens_per_s`` (the coordinator's), ``throughput/train_tokens_per_s`` (trained response
  tokens over the step's wall time);
- every other trainer figure as ``trainer/<name>``;
- eval rounds as the coordinator reports them: ``eval/<label>/acc``, ``eval/<label>/pass@<k>``, ... (AIME 2025 is
  ``eval/aime-2025/*``; AIME 2024 under the guide's label ``eval/math_dapo/*``), plotted against ``eval/step``, the
  trainer step of the round's policy version. Training figures are plotted against ``step``: each report is a row
  of its own (an eval round can arrive after later steps' reports, and Weights & Biases' own step only goes up).

With ``WANDB_MODE=offline`` (no network) the run is written under ``logger.log_path`` and can be uploaded later
with ``wandb sync``.
"""

from __future__ import annotations

import logging

from protos.config import RunConfig
from protos.records import MetricsReport, RoleDone

logger = logging.getLogger(__name__)

# trainer figure -> the guide's name for it
GUIDE_NAMES = {
    "reward_mean": "reward",
    "loss": "loss",
    "staleness_max": "staleness",
    "mean_abs_logprob_diff": "abs_logprob_diff",
}


def read_reports(reader, cursors: dict[str, str], block_s: float) -> list[MetricsReport | RoleDone]:
    """The reports and end markers added to the roles' streams since ``cursors`` (role -> last entry id read,
    advanced in place), waiting up to ``block_s`` for the first; ``reader`` is a ``MetricsStreamReader``."""
    return [entry.done or entry.report for entry in reader.follow(cursors, block_s=block_s)]


def append_step(trainer_steps: list[dict], report: MetricsReport) -> bool:
    """Add a trainer report's step figures to the run's history, in step order: a report retried after a lost reply
    lands twice (it replaces its first copy: False, nothing new to show), and a restarted trainer redoes the steps
    after its checkpoint (they replace the steps it lost: True)."""
    step = {"step": report.step, "policy_version": report.policy_version, **report.values}
    if trainer_steps and trainer_steps[-1]["step"] == report.step:
        trainer_steps[-1] = step
        return False
    while trainer_steps and trainer_steps[-1]["step"] > report.step:
        trainer_steps.pop()
    trainer_steps.append(step)
    return True


def step_metrics(values: dict[str, float], rollout_tokens_per_s: float) -> dict[str, float]:
    """One trainer step's figures under their logged names (see the module doc)."""
    logged = {f"trainer/{name}": value for name, value in values.items()}
    logged.update({guide: values[name] for name, guide in GUIDE_NAMES.items() if name in values})
    if values.get("step_s"):
        logged["throughput/train_tokens_per_s"] = values.get("num_tokens", 0.0) / values["step_s"]
    logged["throughput/rollout_tokens_per_s"] = rollout_tokens_per_s
    return logged


class RunLogger:
    """Writes each step's and each eval round's figures to the configured backend (console lines are the
    launcher's own; the wandb backend adds a Weights & Biases run)."""

    def __init__(self, config: RunConfig):
        self.config = config
        self.run = None
        self.version_offset: int | None = None  # policy version - trainer step (the latest trainer report's)
        if config.logger.backend == "wandb":
            import wandb

            log_dir = config.log_path()
            log_dir.mkdir(parents=True, exist_ok=True)
            self.run = wandb.init(
                project=config.logger.project_name,
                name=config.run_id,
                dir=str(log_dir),
                config=config.model_dump(mode="json"),
            )
            for axis in ("step", "eval/step"):
                self.run.define_metric(axis)
            for pattern in (*GUIDE_NAMES.values(), "trainer/*", "throughput/*"):
                self.run.define_metric(pattern, step_metric="step")
            self.run.define_metric("eval/*", step_metric="eval/step")
            logger.info(
                "Weights & Biases run %s (project %s) in %s", config.run_id, config.logger.project_name, log_dir
            )

    def log_step(self, step: int, policy_version: int, values: dict[str, float], rollout_tokens_per_s: float) -> None:
        self.version_offset = policy_version - step
        if self.run is not None:
            self.run.log({"step": step, **step_metrics(values, rollout_tokens_per_s)})

    def log_coordinator(self, report: MetricsReport) -> None:
        """An eval round's figures (``eval/...``); the coordinator's periodic figures are not logged here. A round
        before any trainer report is the one at the start (step 0)."""
        evals = {k: v for k, v in report.values.items() if k.startswith("eval/") and k != "eval/version"}
        if not evals or self.run is None:
            return
        eval_step = 0 if self.version_offset is None else max(0, report.policy_version - self.version_offset)
        self.run.log({**evals, "eval/step": eval_step})

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()


def follow_run(config: RunConfig, client, timeout_s: float) -> int:
    """Log a run's reports as they arrive until the trainer's end marker, then the coordinator's last ones (its
    final eval round); returns the steps logged. Raises TimeoutError when no report arrives for ``timeout_s``."""
    import time

    from channels.metrics_stream import MetricsStreamReader
    from protos.redis_keys import RedisKeys

    reader = MetricsStreamReader(client, RedisKeys(config.run_id))
    run_logger, cursors, steps, done = RunLogger(config), {"trainer": "0", "coordinator": "0"}, 0, None
    rollout_tokens_per_s, last_report = 0.0, time.monotonic()
    try:
        while done is None:
            reports = read_reports(reader, cursors, block_s=1.0)
            if not reports and time.monotonic() - last_report > timeout_s:
                raise TimeoutError(f"no metrics report from run {config.run_id} for {timeout_s:.0f}s")
            for report in reports:
                last_report = time.monotonic()
                if isinstance(report, RoleDone):
                    done = report if report.role == "trainer" else done
                elif report.role == "coordinator":
                    rollout_tokens_per_s = report.values.get("tokens_per_s", rollout_tokens_per_s)
                    run_logger.log_coordinator(report)
                else:
                    run_logger.log_step(report.step, report.policy_version, report.values, rollout_tokens_per_s)
                    steps += 1
        _log_final_eval(config, reader, cursors["coordinator"], done.policy_version, run_logger)
        return steps
    finally:
        run_logger.finish()


def _log_final_eval(config: RunConfig, reader, cursor: str, final_version: int, run_logger: RunLogger) -> None:
    """The coordinator's reports after the trainer's end marker; when the run evaluates its last step, wait (up to
    ``coordinator.eval.timeout_s``) for that round's report."""
    import time

    evals = config.coordinator.eval
    expected = bool(evals.datasets and evals.interval_steps and config.num_steps % evals.interval_steps == 0)
    deadline = time.monotonic() + evals.timeout_s
    cursors = {"coordinator": cursor}
    while True:
        for report in read_reports(reader, cursors, block_s=1.0):
            if not isinstance(report, MetricsReport):
                continue
            run_logger.log_coordinator(report)
            if report.values.get("eval/version", -1.0) >= final_version:
                return
        if not expected or time.monotonic() > deadline:
            return


def main(argv: list[str] | None = None) -> int:
    """``python -m launcher.run_logger --config run.json [--redis-url URL]``: the run logger on its own, for runs
    that no ``fleetrl demo`` launcher watches (a cluster's pods), e.g. beside the coordinator."""
    import argparse

    import redis

    from protos.config import flag_overrides, load_run_config

    parser = argparse.ArgumentParser(prog="python -m launcher.run_logger", description=main.__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--redis-url", default=None, help="alias of the config key redis_url")
    parser.add_argument("--idle-timeout-s", type=float, default=7200.0, help="give up after this long without reports")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s run_logger %(levelname)s %(name)s: %(message)s")
    config = load_run_config(args.config, [*flag_overrides({"redis_url": args.redis_url}), *args.overrides])
    steps = follow_run(config, redis.Redis.from_url(config.redis_url, socket_timeout=30), args.idle_timeout_s)
    logger.info("run %s done: %d steps logged", config.run_id, steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
