"""Helpers of the agent API's end-to-end tests: a coordinator process serving agents only, and what reached the
trajectory stream."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import redis
import yaml

from protos.records import decode_group
from protos.redis_keys import RedisKeys
from tests.waiting import wait_until

REPO_ROOT = Path(__file__).resolve().parents[3]


def agents_only_config(run_id: str, redis_url: str, port: int, tokens_file: Path, **agent) -> dict:
    """A run fed by agents alone: groups of 2, one group per step, no trainer (admission must not wait for one
    unless ``max_staleness`` says so)."""
    return {
        "run_id": run_id,
        "redis_url": redis_url,
        "num_steps": 100,
        "groups_per_step": 1,
        "max_staleness": agent.pop("max_staleness", 100),
        "coordinator": {"group_size": 2, "admin_port": 0},
        "agent": {"enabled": True, "only_agents": True, "port": port, "tokens_file": str(tokens_file), **agent},
    }


def start_coordinator(config: dict, workdir: Path, servers: str, log_name: str = "coordinator.log"):
    """The coordinator process of ``config`` (written to ``workdir/run.yaml``), once its agent API listens;
    returns (process, log path)."""
    (workdir / "run.yaml").write_text(yaml.safe_dump(config))
    log = workdir / log_name
    process = subprocess.Popen(
        [sys.executable, "-m", "coordinator", "run", "--config", str(workdir / "run.yaml"), "--servers", servers],
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=REPO_ROOT,
    )
    wait_until(
        lambda: "agent API on" in log.read_text() or process.poll() is not None, "the agent API", 120, poll_s=0.2
    )
    assert process.poll() is None, log.read_text()[-3000:]
    return process, log


def queued(redis_url: str, keys: RedisKeys) -> list:
    """The trajectory groups on the run's stream, in order."""
    return [decode_group(fields[b"g"]) for _, fields in redis.Redis.from_url(redis_url).xrange(keys.trajectories)]
