"""Fault test: SIGKILL the trainer process mid-step while the queue holds trajectories, restart it.

Every group pushed must end up consumed exactly once by the surviving lineage of weights (the ledger of
the final checkpoint), none lost, none left pending, versions never going backwards.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from synthetic import push_groups

from modeling.tiny_model import init_tiny
from protos.redis_keys import RedisKeys

RUN_ID = "fault-test"
NUM_GROUPS, GROUPS_PER_STEP = 24, 2




def _start_trainer(model_dir: str, url: str, ckpt_dir: Path, log: Path, *extra: str) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "trainer_service", "train", "--model", model_dir, "--redis-url", url,
        "--linger-s", "0", f"run_id={RUN_ID}", f"trainer.ckpt_dir={ckpt_dir}", "trainer.ckpt_interval=3",
        f"trainer.num_steps={NUM_GROUPS // GROUPS_PER_STEP}", f"coordinator.groups_per_step={GROUPS_PER_STEP}",
        "coordinator.max_staleness=1000", "trainer.geo_mask=null", "trainer.batch_timeout_s=60", *extra,
    ]
    return subprocess.Popen(command, stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)


def _latest_state(ckpt_dir: Path) -> dict:
    """trainer_state.json of the checkpoint ``latest`` names."""
    return json.loads((ckpt_dir / (ckpt_dir / "latest").read_text() / "trainer_state.json").read_text())


@pytest.fixture
def fresh_run(redis_server, tmp_path):
    """(keys, client, tiny model dir) for a run whose Redis keys start empty."""
    keys = RedisKeys(RUN_ID)
    client = redis.Redis.from_url(redis_server.url)
    client.delete(*client.keys(f"fleetrl:{RUN_ID}:*") or ["-"])
    yield keys, client, str(init_tiny(tmp_path / "tiny"))
    client.close()


def _pending(client: redis.Redis, keys: RedisKeys) -> int:
    return int(client.xpending(keys.trajectories, keys.trainer_group)["pending"])


def test_sigkill_mid_step_then_restart_trains_every_group_exactly_once(redis_server, tmp_path, fresh_run):
    keys, client, model_dir = fresh_run
    ckpt_dir, log = tmp_path / "ckpt", tmp_path / "trainer.log"
    push_groups(redis_server.url, keys, list(range(NUM_GROUPS)))  # the queue holds every group up front

    first = _start_trainer(model_dir, redis_server.url, ckpt_dir, log)
    # Kill once a checkpoint exists and entries are read but not yet acknowledged: mid-step. SIGSTOP
    # freezes the trainer so the check and the kill see the same state.
    deadline = time.monotonic() + 180
    while True:
        assert first.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "trainer never reached a checkpoint with entries in flight"
        if (ckpt_dir / "latest").exists() and _pending(client, keys) > 0:
            os.killpg(first.pid, signal.SIGSTOP)
            if _pending(client, keys) > 0:
                break
            os.killpg(first.pid, signal.SIGCONT)
        time.sleep(0.005)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=30)
    killed_at = _latest_state(ckpt_dir)
    pending_at_kill = _pending(client, keys)
    version_at_kill = int(client.get(keys.policy_version))
    assert pending_at_kill > 0 and killed_at["step"] < NUM_GROUPS // GROUPS_PER_STEP

    second = _start_trainer(model_dir, redis_server.url, ckpt_dir, log)
    assert second.wait(timeout=300) == 0, log.read_text()[-3000:]

    final = _latest_state(ckpt_dir)
    assert final["step"] == NUM_GROUPS // GROUPS_PER_STEP
    assert sorted(final["ledger"]) == sorted(f"g{i}" for i in range(NUM_GROUPS))  # none lost, none twice
    assert set(final["ledger"].values()) == {"trained"}
    assert _pending(client, keys) == 0 and client.llen(keys.dead_letters) == 0
    assert int(client.get(keys.policy_version)) > version_at_kill  # the restart published past the dead lineage
    # Versions it skipped are counted for the coordinator: version = steps trained + versions skipped.
    lost = version_at_kill - killed_at["policy_version"]
    skipped = int(client.get(keys.version_jumps) or 0)
    assert skipped == (lost + 1 if lost > 0 else 0)
    assert int(client.get(keys.policy_version)) == final["step"] + skipped
    assert f"{pending_at_kill} entries reclaimed" in log.read_text()  # the restart took them over


def test_a_group_pushed_twice_is_trained_once(redis_server, tmp_path, fresh_run):
    keys, client, model_dir = fresh_run
    # A coordinator that lost the reply of a push retries it: the same group lands twice on the stream.
    push_groups(redis_server.url, keys, list(range(10)) + [3] + list(range(10, NUM_GROUPS)))
    trainer = _start_trainer(model_dir, redis_server.url, tmp_path / "ckpt", tmp_path / "trainer.log")
    assert trainer.wait(timeout=300) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    final = _latest_state(tmp_path / "ckpt")
    assert sorted(final["ledger"]) == sorted(f"g{i}" for i in range(NUM_GROUPS))
    assert final["totals"]["duplicates_skipped"] == 1 and final["totals"]["samples_trained"] == 4 * NUM_GROUPS
    assert _pending(client, keys) == 0 and client.xinfo_groups(keys.trajectories)[0]["lag"] == 0


def test_megatron_backend_runs_in_the_trainer_process_and_publishes(redis_server, tmp_path, fresh_run):
    keys, client, model_dir = fresh_run
    push_groups(redis_server.url, keys, list(range(4)))
    log = tmp_path / "trainer.log"
    trainer = _start_trainer(model_dir, redis_server.url, tmp_path / "ckpt", log,
                             "trainer.backend=megatron", "trainer.num_steps=2")
    assert trainer.wait(timeout=300) == 0, log.read_text()[-3000:]
    final = _latest_state(tmp_path / "ckpt")
    assert final["step"] == 2 and sorted(final["ledger"]) == [f"g{i}" for i in range(4)]
    assert int(client.get(keys.policy_version)) == 2 and client.exists(keys.manifest(2))
    assert _pending(client, keys) == 0


def test_a_version_jump_counted_twice_by_restarts_before_the_publish_is_added_once(fresh_run):
    from trainer_service.__main__ import count_version_jump

    keys, client, _ = fresh_run
    assert count_version_jump(client, keys, skipped=3, target_version=8) == 3
    # The trainer died after counting and before publishing v8; its restart counts the same jump again.
    assert count_version_jump(client, keys, skipped=3, target_version=8) == 3
    assert count_version_jump(client, keys, skipped=2, target_version=11) == 5  # a later restart: a new jump
    assert int(client.get(keys.version_jumps)) == 5
    # A trainer with no checkpoint on this run id (trainer.resume=none) starts at 13 having trained nothing: all 13
    # versions are jumps of its lineage, whatever earlier trainers counted.
    assert count_version_jump(client, keys, skipped=13, target_version=13, new_lineage=True) == 13
