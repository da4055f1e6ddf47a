"""The run logger: the trainer's and the coordinator's metrics streams (real valkey) read back and written to a real
Weights & Biases run in offline mode, whose history is then read from its run file."""

from __future__ import annotations

import json
import time

import pytest
import redis

from launcher.run_logger import RunLogger, follow_run, step_metrics
from protos.config import load_run_config
from protos.records import MetricsReport, RoleDone, encode
from protos.redis_keys import RedisKeys
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

# What the guide says its logger shows: reward, the two eval sets, loss, staleness, |dlogp|, throughput.
GUIDE_METRICS = {
    "reward",
    "loss",
    "staleness",
    "abs_logprob_diff",
    "throughput/rollout_tokens_per_s",
    "throughput/train_tokens_per_s",
    "eval/aime-2025/acc",
    "eval/math_dapo/acc",
}


def trainer_values(step: int) -> dict[str, float]:
    return {
        "reward_mean": 0.1 * step,
        "loss": 1.0 / step,
        "staleness_max": 1.0,
        "mean_abs_logprob_diff": 0.01,
        "num_tokens": 800.0,
        "step_s": 2.0,
    }


def write_run(client: redis.Redis, keys: RedisKeys, num_steps: int) -> None:
    """A run's streams as the roles write them: an eval at the start, steps, an eval after step 2, the end marker."""
    coordinator, trainer = keys.metrics("coordinator"), keys.metrics("trainer")
    evals = {"eval/aime-2025/acc": 0.25, "eval/math_dapo/acc": 0.5, "eval/version": 10.0}
    client.xadd(coordinator, {"m": encode(MetricsReport("coordinator", 0, 10, time.time(), {"tokens_per_s": 900.0}))})
    client.xadd(coordinator, {"m": encode(MetricsReport("coordinator", 0, 10, time.time(), evals))})
    for step in range(1, num_steps + 1):
        client.xadd(
            trainer, {"m": encode(MetricsReport("trainer", step, 10 + step, time.time(), trainer_values(step)))}
        )
    later = {**evals, "eval/aime-2025/acc": 0.75, "eval/version": 12.0}
    client.xadd(coordinator, {"m": encode(MetricsReport("coordinator", 2, 12, time.time(), later))})
    client.xadd(trainer, {"d": encode(RoleDone("trainer", num_steps, 10 + num_steps, time.time()))})


def offline_history(log_dir, timeout_s: float = 60.0) -> tuple[dict, list[dict]]:
    """(run record, history rows) of the single offline run under ``log_dir``, read from its transaction log once
    wandb's service process has written the run's exit record into it."""

    def finished() -> tuple[dict, list[dict]] | None:
        run, rows, done = _read_run_file(log_dir)
        return (run, rows) if done else None

    return wait_until(finished, f"the exit record of the offline run under {log_dir}", timeout_s, poll_s=0.5)


def _read_run_file(log_dir) -> tuple[dict, list[dict], bool]:
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore

    (run_file,) = log_dir.glob("wandb/offline-run-*/run-*.wandb")
    store = datastore.DataStore()
    store.open_for_scan(str(run_file))
    run, rows, finished = {}, [], False
    while (data := store.scan_data()) is not None:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = {"project": record.run.project, "name": record.run.display_name}
        elif kind == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
        finished = finished or kind == "exit"
    return run, rows, finished


def test_wandb_logger_writes_the_guides_metrics_from_the_metrics_streams(redis_url, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log_dir = tmp_path / "logs"
    config = load_run_config(
        overrides=["run_id=beam-toy", "logger.backend=wandb", "logger.project_name=fleetrl-test"],
        environ={"LOG_PATH": str(log_dir)},  # the guide's variable: where the logs (and this run) go
    )
    client = redis.Redis.from_url(redis_url)
    keys = RedisKeys(config.run_id)
    write_run(client, keys, num_steps=3)
    assert follow_run(config, client, timeout_s=30) == 3  # what `python -m launcher.run_logger` runs

    run, rows = offline_history(log_dir)
    assert run == {"project": "fleetrl-test", "name": "beam-toy"}
    logged = {key for row in rows for key in row}
    assert GUIDE_METRICS <= logged, GUIDE_METRICS - logged
    steps = {row["step"]: row for row in rows if "step" in row}
    assert [steps[step]["reward"] for step in (1, 2, 3)] == pytest.approx([0.1, 0.2, 0.3])
    assert steps[2]["throughput/train_tokens_per_s"] == 400.0 and steps[2]["trainer/loss"] == 0.5
    assert steps[3]["throughput/rollout_tokens_per_s"] in (0.0, 900.0)  # the last coordinator figure read before it
    # each eval round at the trainer step of its policy version (v10: the start, v12: after step 2), whatever order
    # the two streams were read in
    evals = {row["eval/step"]: row for row in rows if "eval/step" in row}
    assert sorted(evals) == [0, 2]
    assert (evals[0]["eval/aime-2025/acc"], evals[0]["eval/math_dapo/acc"]) == (0.25, 0.5)
    assert (evals[2]["eval/aime-2025/acc"], evals[2]["eval/math_dapo/acc"]) == (0.75, 0.5)


def test_console_logger_writes_no_run_and_names_match_the_guide():
    config = load_run_config(overrides=["logger.backend=console"])
    run_logger = RunLogger(config)
    run_logger.log_step(1, 1, trainer_values(1), 500.0)
    run_logger.finish()
    assert run_logger.run is None
    named = step_metrics(trainer_values(1), 500.0)
    assert named["reward"] == 0.1 and named["staleness"] == 1.0 and named["abs_logprob_diff"] == 0.01
    assert named["throughput/rollout_tokens_per_s"] == 500.0 and named["trainer/reward_mean"] == 0.1
