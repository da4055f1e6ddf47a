"""Helpers of test_coordinator_run.py: rollout servers following RUN_ID, one trainer + coordinator run, the
admin CLI, and what the run left in Redis."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import yaml

from channels.metrics_stream import MetricsStreamReader
from launcher.redis_server import free_port
from protos.records import decode_group
from protos.redis_keys import RedisKeys
from tests.rollout_service.server_process import ServerProcess, spawn_rollout_server
from tests.waiting import WaitTimeout, wait_until

RUN_ID = "coord-run"
KEYS = RedisKeys(RUN_ID)
PLUGINS = "tests.coordinator.reward_plugins"


@contextlib.contextmanager
def following_servers(
    model_dir: str, redis_url: str, logs: Path, num_servers: int = 2
) -> Iterator[list[ServerProcess]]:
    """Rollout server processes following RUN_ID's weight announcements, stopped on exit."""
    started = [
        spawn_rollout_server(
            model_dir,
            logs / f"rollout-{i}.log",
            "--server-id",
            f"rollout-{i}",
            "--redis-url",
            redis_url,
            "--run-id",
            RUN_ID,
            env={"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": str(i % (os.cpu_count() or 1))},
        )
        for i in range(num_servers)
    ]
    try:
        for server in started:
            server.wait_serving(timeout_s=300)
        yield started
    finally:
        for server in started:
            if server.process.poll() is None:
                os.killpg(server.process.pid, signal.SIGTERM)
        for server in started:
            try:
                server.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(server.process.pid, signal.SIGKILL)
                server.process.wait()


@dataclass
class Run:
    """One trainer + coordinator run against the module's servers."""

    out: Path
    trainer: subprocess.Popen
    coordinator: subprocess.Popen
    admin: str
    metrics_url: str
    start_version: int
    config: dict

    def log(self, role: str) -> str:
        return (self.out / f"{role}.log").read_text(errors="replace")[-4000:]

    def wait(self, timeout_s: float = 240) -> None:
        """Wait for the coordinator to finish; it must exit 0."""
        try:
            code = self.coordinator.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"coordinator still running after {timeout_s}s:\n{self.log('coordinator')}\n{self.log('trainer')}"
            )
        assert code == 0, self.log("coordinator") + self.log("trainer")

    def stop(self) -> None:
        for process in (self.coordinator, self.trainer):
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def run_config(tmp_path: Path, coordinator: dict, num_steps: int) -> tuple[dict, str, int]:
    """The run's config (coordinator section merged with ``coordinator``; its ``groups_per_step`` goes to the top),
    its admin address and metrics port."""
    admin, metrics_port = f"127.0.0.1:{free_port()}", free_port()
    coordinator = dict(coordinator)
    config = {
        "run_id": RUN_ID,
        "out_dir": str(tmp_path),
        "num_steps": num_steps,
        "max_staleness": 1,
        "groups_per_step": coordinator.pop("groups_per_step"),  # a top-level key (several roles read it)
        "coordinator": {
            "dashboard": False,
            "admin_port": int(admin.split(":")[1]),
            "metrics_port": metrics_port,
            **coordinator,
        },
        # trim_acknowledged off: the tests read the whole trajectory stream afterwards as the record of pushes
        "trainer": {
            "geo_mask": None,
            "token_tis_cap": 2.0,
            "batch_timeout_s": 120,
            "resume": "none",
            "trim_acknowledged": False,
        },
    }
    return config, admin, metrics_port


def start_run(
    tmp_path: Path, model_dir: str, servers: list[ServerProcess], redis_url: str, coordinator: dict, num_steps: int
) -> Run:
    """Clear the previous run's streams, start the trainer, wait for its start version, start the coordinator."""
    client = redis.Redis.from_url(redis_url)
    client.delete(
        KEYS.trajectories,
        KEYS.prompt_cursor,
        KEYS.control,
        KEYS.dead_letters,
        KEYS.metrics("trainer"),
        KEYS.metrics("coordinator"),
    )
    before = client.get(KEYS.policy_version)
    config, admin, metrics_port = run_config(tmp_path, coordinator, num_steps)
    config_path = tmp_path / "run.yaml"
    config_path.write_text(yaml.safe_dump(config))
    trainer = _spawn(
        tmp_path / "trainer.log",
        "trainer_service",
        "train",
        "--model",
        model_dir,
        "--redis-url",
        redis_url,
        "--config",
        str(config_path),
        "--linger-s",
        "30",
    )
    start_version = _wait_for_trainer_start(client, before, trainer, tmp_path / "trainer.log")
    coordinator_process = spawn_coordinator(tmp_path, model_dir, servers, redis_url)
    return Run(
        tmp_path, trainer, coordinator_process, admin, f"http://127.0.0.1:{metrics_port}/metrics", start_version, config
    )


def spawn_coordinator(tmp_path: Path, model_dir: str, servers: list[ServerProcess], redis_url: str) -> subprocess.Popen:
    """The run's coordinator process on ``tmp_path/run.yaml``, logging to ``tmp_path/coordinator.log`` (overwritten)."""
    return _spawn(
        tmp_path / "coordinator.log",
        "coordinator",
        "run",
        "--servers",
        ",".join(s.address for s in servers),
        "--redis-url",
        redis_url,
        "--model",
        model_dir,
        "--config",
        str(tmp_path / "run.yaml"),
    )


def _spawn(log: Path, module: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _wait_for_trainer_start(client: redis.Redis, before: bytes | None, trainer, log: Path, timeout_s=180) -> int:
    """A fresh trainer sets v0 (first run) or publishes the version after the last published one."""
    expected = 0 if before is None else int(before) + 1

    def started() -> bool:
        assert trainer.poll() is None, log.read_text()[-3000:]
        raw = client.get(KEYS.policy_version)
        return raw is not None and int(raw) >= expected

    wait_until(started, f"the trainer at v{expected} or later", timeout_s, poll_s=0.2)
    return int(client.get(KEYS.policy_version))


def fleetrl(run: Run, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "launcher.cli", *argv, "--admin", run.admin],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def status(run: Run) -> dict:
    return json.loads(fleetrl(run, "status", "--json").stdout)


def wait_for_admin(run: Run, timeout_s: float = 120) -> dict:

    def answered() -> dict | None:
        assert run.coordinator.poll() is None, run.log("coordinator")
        result = fleetrl(run, "status", "--json", check=False)
        return json.loads(result.stdout) if result.returncode == 0 else None

    try:
        return wait_until(answered, "the coordinator's admin API", timeout_s, poll_s=0.5)
    except WaitTimeout as timeout:
        pytest.fail(f"{timeout}\n{run.log('coordinator')}")


def pushed_groups(redis_url: str) -> list:
    entries = redis.Redis.from_url(redis_url).xrange(KEYS.trajectories)
    return [decode_group(fields[b"g"]) for _, fields in entries]


def coordinator_reports(redis_url: str) -> list:
    entries = MetricsStreamReader(redis.Redis.from_url(redis_url), KEYS).after("coordinator", "0")
    return [entry.report for entry in entries if entry.report is not None]


def assert_every_slot_once_within_the_bound(groups: list, num_slots: int, start_version: int, b: int, k: int) -> None:
    assert sorted(g.admission_index for g in groups) == list(range(num_slots)), "a slot was lost or pushed twice"
    for group in groups:
        oldest = min(span.version for sample in group.samples for span in sample.version_spans)
        staleness = start_version + group.admission_index // b - oldest
        assert 0 <= staleness <= k, (group.admission_index, oldest, start_version)
