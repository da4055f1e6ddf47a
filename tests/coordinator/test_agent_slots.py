"""Agent groups in the scheduler's slot order: a dropped group's slot is filled by a complete group behind it, so
groups pushed in slot order never wait on a hole (and a moved group is trained no later than admitted for)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import redis.asyncio as aioredis

from channels.trajectory_stream import TrajectoryStreamWriter
from coordinator.fleet import Fleet
from coordinator.scheduler import Scheduler
from coordinator.tasks import EchoTask
from protos.config import load_run_config
from protos.records import Array, FinishReason, Sample, TrajectoryGroup, VersionSpan
from protos.redis_keys import RedisKeys

pytestmark = pytest.mark.integration


def _group(name: str, slot: int) -> TrajectoryGroup:
    sample = Sample(
        Array.from_numpy(np.array([5], np.int32)),
        Array.from_numpy(np.array([-0.5], np.float32)),
        [VersionSpan(0, 0, 1)],
        FinishReason.STOP,
        1.0,
    )
    prompt = Array.from_numpy(np.array([1, 5], np.int32))
    return TrajectoryGroup(name, f"agent:{name}", prompt, [sample], "agent:t", slot, 0, 0.0)


async def _scheduler(redis_url: str) -> Scheduler:
    config = load_run_config(overrides=["groups_per_step=1", "max_staleness=10", "coordinator.group_size=1"])
    queue = TrajectoryStreamWriter(aioredis.Redis.from_url(redis_url), RedisKeys("slots"))
    return Scheduler(config, Fleet([]), queue, EchoTask(), 20)


def test_a_complete_group_behind_a_dropped_one_moves_into_its_slot_and_is_pushed(redis_url):
    async def scenario():
        scheduler = await _scheduler(redis_url)
        dropped, behind = scheduler.admit_external(), scheduler.admit_external()
        await scheduler.complete_external(behind, _group("behind", behind))
        assert not scheduler.pushed("behind") and scheduler.stats.groups_pushed == 0  # waits for slot 0
        await scheduler.release_slot(dropped)
        assert scheduler.pushed("behind") and scheduler.stats.groups_pushed == 1
        assert scheduler.admit_external() == behind  # the vacated slot is the next one admitted

    asyncio.run(scenario())


def test_a_group_completing_after_a_drop_takes_the_lower_released_slot(redis_url):
    async def scenario():
        scheduler = await _scheduler(redis_url)
        dropped, later = scheduler.admit_external(), scheduler.admit_external()
        await scheduler.release_slot(dropped)  # nothing complete behind it yet
        await scheduler.complete_external(later, _group("later", later))
        assert scheduler.pushed("later") and scheduler.stats.groups_pushed == 1
        assert scheduler.in_flight == set() and scheduler.admit_external() == later

    asyncio.run(scenario())
