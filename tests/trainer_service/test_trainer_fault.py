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

from channels.version_board import VersionBoard
from modeling.tiny_model import init_tiny
from protos.redis_keys import RedisKeys
from tests.waiting import wait_until

pytestmark = pytest.mark.e2e

RUN_ID = "fault-test"
NUM_GROUPS, GROUPS_PER_STEP = 24, 2


def _start_trainer(model_dir: str, url: str, ckpt_dir: Path, log: Path, *extra: str) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "trainer_service",
        "train",
        "--model",
        model_dir,
        "--redis-url",
        url,
        "--linger-s",
        "0",
        f"run_id={RUN_ID}",
        f"trainer.ckpt_dir={ckpt_dir}",
        "trainer.ckpt_interval=3",
        f"num_steps={NUM_GROUPS // GROUPS_PER_STEP}",
        f"groups_per_step={GROUPS_PER_STEP}",
        "max_staleness=1000",
        "trainer.geo_mask=null",
        "trainer.batch_timeout_s=60",
        *extra,
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


def _last_reported_step(client: redis.Redis, keys: RedisKeys) -> int:
    from protos.records import decode_metrics

    newest = client.xrevrange(keys.metrics("trainer"), count=1)
    return decode_metrics(newest[0][1][b"m"]).step if newest and b"m" in newest[0][1] else 0


def _alive(trainer: subprocess.Popen, log: Path) -> bool:
    """True while the trainer process runs; fails with its log's tail once it exited."""
    assert trainer.poll() is None, log.read_text()[-3000:]
    return True


def _pending(client: redis.Redis, keys: RedisKeys) -> int:
    return int(client.xpending(keys.trajectories, keys.trainer_group)["pending"])


def test_sigkill_mid_step_then_restart_trains_every_group_exactly_once(redis_server, tmp_path, fresh_run):
    keys, client, model_dir = fresh_run
    ckpt_dir, log = tmp_path / "ckpt", tmp_path / "trainer.log"
    push_groups(redis_server.url, keys, list(range(NUM_GROUPS)))  # the queue holds every group up front

    first = _start_trainer(model_dir, redis_server.url, ckpt_dir, log)
    # Kill once a checkpoint exists and entries are read but not yet acknowledged: mid-step. SIGSTOP
    # freezes the trainer so the check and the kill see the same state.

    def stopped_mid_step() -> bool:
        assert first.poll() is None, log.read_text()[-3000:]
        if not ((ckpt_dir / "latest").exists() and _pending(client, keys) > 0):
            return False
        os.killpg(first.pid, signal.SIGSTOP)
        # An XACK the trainer wrote just before it stopped can still reach Redis after a first look (another
        # connection: no ordering): the pending count must be the same twice, a moment apart.
        seen = _pending(client, keys)
        time.sleep(0.2)  # kept: nothing tells when such an XACK has landed; "a moment apart" is the check
        if seen > 0 and _pending(client, keys) == seen:
            return True
        os.killpg(first.pid, signal.SIGCONT)
        return False

    wait_until(stopped_mid_step, "the trainer stopped at a checkpoint with entries in flight", 180, poll_s=0.005)
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
    assert final["totals"]["samples_trained"] == 4 * NUM_GROUPS  # the restart counts on from the checkpoint's totals
    assert _pending(client, keys) == 0 and client.llen(keys.dead_letters) == 0
    # Versions published past the checkpoint were trained again (trainer_service/replay.py), none skipped: the
    # version is the steps trained, the coordinator's offset stays 0.
    assert int(client.get(keys.policy_version)) == final["step"] == final["policy_version"]
    assert int(client.get(keys.version_offset) or 0) == 0
    if version_at_kill > killed_at["policy_version"]:
        assert f"replayed v{version_at_kill}: the published weights, bit for bit" in log.read_text()
    assert f"{pending_at_kill} entries reclaimed" in log.read_text()  # the restart took them over


def test_a_trainer_killed_between_publish_and_checkpoint_replays_the_step_and_skips_no_version(
    redis_server, tmp_path, fresh_run
):
    """The chaos soak's find: the restart published its older weights as latest + 1, every queued group looked a
    version staler than it was, and whole steps of on-policy groups were dropped as stale."""
    keys, client, model_dir = fresh_run
    ckpt_dir, log = tmp_path / "ckpt", tmp_path / "trainer.log"
    push_groups(redis_server.url, keys, list(range(4 * GROUPS_PER_STEP)))  # four steps; checkpoints every third
    first = _start_trainer(model_dir, redis_server.url, ckpt_dir, log)
    # step 4 published and reported: it waits for step 5's groups now
    wait_until(lambda: _alive(first, log) and _last_reported_step(client, keys) >= 4, "step 4 reported", 180)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=30)
    # step 4's groups are pending (and step 1-3's too if the checkpoint's durable half was still running then)
    assert _latest_state(ckpt_dir)["policy_version"] == 3 and _pending(client, keys) in (
        GROUPS_PER_STEP,
        4 * GROUPS_PER_STEP,
    )

    dead_address = VersionBoard(client, keys).manifest(4).publisher_address  # the killed trainer's bus

    push_groups(redis_server.url, keys, list(range(4 * GROUPS_PER_STEP, NUM_GROUPS)))
    second = _start_trainer(model_dir, redis_server.url, ckpt_dir, log)
    assert second.wait(timeout=300) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert "replaying the steps of v4..v4" in text and "replayed v4: the published weights, bit for bit" in text
    final = _latest_state(ckpt_dir)
    steps = NUM_GROUPS // GROUPS_PER_STEP
    assert final["policy_version"] == int(client.get(keys.policy_version)) == steps
    assert int(client.get(keys.version_offset)) == 0  # no version skipped: the coordinator's slot map holds
    announced = [int(f[b"v"]) for _, f in client.xrange(keys.weight_announcements)]
    assert sorted(set(announced)) == list(range(1, steps + 1))
    # v4 again under its number (no new lineage), from the restarted trainer: no server could fetch it from the dead one
    assert announced.count(4) == 2 and VersionBoard(client, keys).manifest(4).publisher_address != dead_address
    # step 4's groups trained again from the v3 weights, as the first time; every group trained once
    assert final["trained_versions"]["g6"] == final["trained_versions"]["g7"] == 3
    assert set(final["ledger"].values()) == {"trained"} and len(final["ledger"]) == NUM_GROUPS


def test_a_trainer_killed_after_its_checkpoint_publishes_that_version_again_from_its_own_weight_bus(
    redis_server, tmp_path, fresh_run
):
    """The long chaos soak's find: killed after publishing and checkpointing v3, the trainer left v3's manifest
    naming its dead weight bus; a server that had not fetched v3 yet never could, and the run stalled."""
    keys, client, model_dir = fresh_run
    ckpt_dir, log = tmp_path / "ckpt", tmp_path / "trainer.log"
    push_groups(redis_server.url, keys, list(range(3 * GROUPS_PER_STEP)))  # three steps; checkpoints every third
    first = _start_trainer(model_dir, redis_server.url, ckpt_dir, log)
    wait_until(  # v3 out, durable
        lambda: (
            _alive(first, log) and (ckpt_dir / "latest").exists() and _latest_state(ckpt_dir)["policy_version"] >= 3
        ),
        "a checkpoint at v3",
        180,
    )
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=30)
    dead_address = VersionBoard(client, keys).manifest(3).publisher_address
    assert _latest_state(ckpt_dir)["policy_version"] == 3

    push_groups(redis_server.url, keys, list(range(3 * GROUPS_PER_STEP, NUM_GROUPS)))
    second = _start_trainer(model_dir, redis_server.url, ckpt_dir, log)
    assert second.wait(timeout=300) == 0, log.read_text()[-3000:]
    announced = [int(f[b"v"]) for _, f in client.xrange(keys.weight_announcements)]
    assert announced.count(3) == 2 and VersionBoard(client, keys).manifest(3).publisher_address != dead_address
    steps = NUM_GROUPS // GROUPS_PER_STEP
    assert sorted(set(announced)) == list(range(1, steps + 1)) and int(client.get(keys.version_offset)) == 0
    final = _latest_state(ckpt_dir)
    assert final["policy_version"] == steps and set(final["ledger"].values()) == {"trained"}


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
    trainer = _start_trainer(
        model_dir, redis_server.url, tmp_path / "ckpt", log, "trainer.backend=megatron", "num_steps=2"
    )
    assert trainer.wait(timeout=300) == 0, log.read_text()[-3000:]
    final = _latest_state(tmp_path / "ckpt")
    assert final["step"] == 2 and sorted(final["ledger"]) == [f"g{i}" for i in range(4)]
    assert int(client.get(keys.policy_version)) == 2 and client.exists(keys.manifest(2))
    assert _pending(client, keys) == 0


def test_a_step_that_publishes_nothing_lowers_version_minus_steps_for_the_coordinator(
    redis_server, tmp_path, fresh_run
):
    keys, client, model_dir = fresh_run
    # g5 has NaN rewards: step 3 (g4, g5) has a non-finite loss and is skipped, no version published.
    push_groups(redis_server.url, keys, list(range(NUM_GROUPS)), nonfinite=(5,))
    log = tmp_path / "trainer.log"
    trainer = _start_trainer(model_dir, redis_server.url, tmp_path / "ckpt", log)
    assert trainer.wait(timeout=300) == 0, log.read_text()[-3000:]
    final = _latest_state(tmp_path / "ckpt")
    steps = NUM_GROUPS // GROUPS_PER_STEP
    assert final["step"] == steps and final["ledger"]["g4"] == final["ledger"]["g5"] == "nonfinite"
    assert int(client.get(keys.policy_version)) == steps - 1 == final["policy_version"]
    # The coordinator's slot map: version - offset = steps taken, so slot i still maps to the version that trains it.
    assert int(client.get(keys.version_offset)) == -1


def test_a_redis_outage_while_the_trainer_waits_for_groups_neither_stops_it_nor_loses_a_group(
    redis_server, tmp_path, fresh_run
):
    from tests.redis_faults import redis_proxy

    keys, client, model_dir = fresh_run
    ckpt_dir, log = tmp_path / "ckpt", tmp_path / "trainer.log"
    half = NUM_GROUPS // 2
    push_groups(redis_server.url, keys, list(range(half)))
    with redis_proxy(redis_server.url) as (proxy_url, proxy):
        trainer = _start_trainer(model_dir, proxy_url, ckpt_dir, log)
        wait_until(
            lambda: _alive(trainer, log) and int(client.get(keys.policy_version) or 0) >= half // GROUPS_PER_STEP,
            "the first half trained",
            180,
            poll_s=0.1,
        )
        proxy.cut()  # it now waits for more groups with Redis unreachable
        push_groups(redis_server.url, keys, list(range(half, NUM_GROUPS)))
        # several refused attempts: with the retry policy's doubling pauses (0.1 s first), about 1.5 s of outage
        wait_until(lambda: proxy.refused >= 5, "five refused connections of the trainer", 60)
        assert trainer.poll() is None, log.read_text()[-3000:]
        proxy.restore()
        assert trainer.wait(timeout=300) == 0, log.read_text()[-3000:]
    final = _latest_state(ckpt_dir)
    assert final["step"] == NUM_GROUPS // GROUPS_PER_STEP
    assert sorted(final["ledger"]) == sorted(f"g{i}" for i in range(NUM_GROUPS))
    assert _pending(client, keys) == 0 and proxy.refused > 0  # it kept trying while Redis was away
    assert "Redis unreachable" in log.read_text() or "failed, retrying" in log.read_text()


def test_a_trainer_restarted_without_a_checkpoint_behind_a_published_version_refuses_and_publishes_nothing(
    redis_server, tmp_path, fresh_run
):
    """The H200 run's find (issue 26): restarted with no checkpoint, the trainer published its model_path weights as
    latest + 1 (v11: the policy rewound under a newer number) and dropped every queued group as stale. It must
    refuse to start, with the exit code the launcher does not restart, and publish nothing."""
    from protos.exit_codes import EXIT_CANNOT_RESTART

    keys, client, model_dir = fresh_run
    ckpt_dir, log = tmp_path / "ckpt", tmp_path / "trainer.log"
    push_groups(redis_server.url, keys, list(range(NUM_GROUPS)))
    off = ["trainer.ckpt_interval=0"]  # as a ckpt_interval beyond the step the trainer died at
    first = _start_trainer(model_dir, redis_server.url, ckpt_dir, log, *off)
    wait_until(  # three steps trained and published, none saved
        lambda: _alive(first, log) and int(client.get(keys.policy_version) or 0) >= 3, "v3 published", 180
    )
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=30)
    assert _pending(client, keys) >= 3 * GROUPS_PER_STEP  # every entry read is still pending: nothing acknowledged
    published = int(client.get(keys.policy_version))
    announced = client.xlen(keys.weight_announcements)

    second = _start_trainer(model_dir, redis_server.url, ckpt_dir, log, *off)
    assert second.wait(timeout=120) == EXIT_CANNOT_RESTART, log.read_text()[-3000:]
    assert int(client.get(keys.policy_version)) == published and not client.exists(keys.manifest(published + 1))
    assert client.xlen(keys.weight_announcements) == announced  # nothing published under any number
    assert _pending(client, keys) >= 3 * GROUPS_PER_STEP  # the entries wait for a trainer that can resume


def test_an_idle_trainer_acknowledges_the_entries_of_its_durable_checkpoint_without_another_step(
    redis_server, tmp_path, fresh_run
):
    """The checkpoint of step 3 becomes durable on the writer's thread while the trainer already waits for step 4's
    groups, which do not come: its entries are acknowledged during the wait, not held until the next step."""
    keys, client, model_dir = fresh_run
    ckpt_dir, log = tmp_path / "ckpt", tmp_path / "trainer.log"
    push_groups(redis_server.url, keys, list(range(3 * GROUPS_PER_STEP)))  # three steps; the checkpoint at step 3
    trainer = _start_trainer(model_dir, redis_server.url, ckpt_dir, log)
    try:
        wait_until(
            lambda: _alive(trainer, log) and (ckpt_dir / "latest").exists() and _pending(client, keys) == 0,
            "a checkpoint and no entry pending",
            180,
        )
        assert _latest_state(ckpt_dir)["step"] == 3 and _last_reported_step(client, keys) == 3
        assert trainer.poll() is None  # idle: waiting for step 4's groups
    finally:
        os.killpg(trainer.pid, signal.SIGKILL)
        trainer.wait(timeout=30)
