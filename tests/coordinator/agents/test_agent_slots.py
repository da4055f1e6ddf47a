"""Agent groups in the scheduler's slot order: a dropped group's slot is filled by a complete group behind it, so
groups pushed in slot order never wait on a hole (and a moved group is trained no later than admitted for); a
group waiting for its rewards lets complete groups behind it go first while the staleness bound holds for it."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import redis.asyncio as aioredis

from channels.trajectory_stream import TrajectoryStreamWriter
from coordinator.agents.slots import AgentSlots
from coordinator.fleet import Fleet
from coordinator.scheduler import Scheduler
from coordinator.tasks import EchoTask
from protos.config import load_run_config
from protos.records import Array, FinishReason, Sample, TrajectoryGroup, VersionSpan, decode_group
from protos.redis_keys import RedisKeys

pytestmark = pytest.mark.integration


def _group(name: str, slot: int, version: int = 0) -> TrajectoryGroup:
    sample = Sample(
        Array.from_numpy(np.array([5], np.int32)),
        Array.from_numpy(np.array([-0.5], np.float32)),
        [VersionSpan(version, 0, 1)],
        FinishReason.STOP,
        1.0,
    )
    prompt = Array.from_numpy(np.array([1, 5], np.int32))
    return TrajectoryGroup(name, f"agent:{name}", prompt, [sample], "agent:t", slot, 0, 0.0)


class _Events:
    """What the SessionBook hears of its groups' slots (slots.SlotEvents), recorded."""

    def __init__(self):
        self.moves: list[tuple[int, int]] = []
        self.pushed: list[str] = []

    async def group_pushed(self, group_id: str) -> None:
        self.pushed.append(group_id)

    def group_moved(self, old_slot: int, new_slot: int) -> None:
        self.moves.append((old_slot, new_slot))


async def _scheduler(redis_url: str, max_staleness: int = 10) -> tuple[Scheduler, AgentSlots]:
    overrides = ["groups_per_step=1", f"max_staleness={max_staleness}", "coordinator.group_size=1"]
    config = load_run_config(overrides=overrides)
    queue = TrajectoryStreamWriter(aioredis.Redis.from_url(redis_url), RedisKeys("slots"))
    scheduler = Scheduler(config, Fleet([]), queue, EchoTask(), 20)
    return scheduler, AgentSlots(scheduler, _Events())


def test_a_complete_group_behind_a_dropped_one_moves_into_its_slot_and_is_pushed(redis_url):
    async def scenario():
        scheduler, slots = await _scheduler(redis_url)
        dropped, behind = slots.admit(), slots.admit()
        await slots.complete(behind, _group("behind", behind))
        assert not slots.is_pushed("behind") and scheduler.stats.groups_pushed == 0  # waits for slot 0
        await slots.release(dropped)
        assert slots.is_pushed("behind") and scheduler.stats.groups_pushed == 1
        assert slots.admit() == behind  # the vacated slot is the next one admitted

    asyncio.run(scenario())


def test_a_group_completing_after_a_drop_takes_the_lower_released_slot(redis_url):
    async def scenario():
        scheduler, slots = await _scheduler(redis_url)
        dropped, later = slots.admit(), slots.admit()
        await slots.release(dropped)  # nothing complete behind it yet
        await slots.complete(later, _group("later", later))
        assert slots.is_pushed("later") and scheduler.stats.groups_pushed == 1
        assert scheduler.in_flight == set() and slots.admit() == later

    asyncio.run(scenario())


def test_a_group_waiting_for_rewards_moves_behind_a_complete_one_and_is_pushed_once_at_its_new_slot(redis_url):
    async def scenario():
        scheduler, slots = await _scheduler(redis_url)
        waiting, own = slots.admit(), scheduler.admit()[0]
        await slots.wait_rewards(waiting, 0)
        await scheduler.complete(own, _group("own", own))
        assert scheduler.stats.groups_pushed == 1 and slots.events.moves == [
            (0, 1)
        ]  # the waiting group now holds slot 1
        assert scheduler.in_flight == {1}
        # a restart resumes the prompts after the pushed group's: the waiting group draws none to draw again
        assert (await scheduler.queue.prompt_cursor()).position == scheduler.task.cursor()
        await slots.complete(1, _group("waiting", 1))
        assert slots.is_pushed("waiting") and scheduler.stats.groups_pushed == 2 and scheduler.in_flight == set()
        stream = await scheduler.queue.client.xrange(RedisKeys("slots").trajectories)
        queued = [decode_group(fields[b"g"]) for _, fields in stream]
        # each once, in slot order; the coordinator's own group moved to slot 0 and its id numbers that slot
        assert [(g.group_id, g.admission_index) for g in queued] == [("agent:own-0", 0), ("waiting", 1)]

    asyncio.run(scenario())


def test_a_complete_group_waits_where_going_first_would_make_the_waiting_group_stale(redis_url):
    async def scenario():
        scheduler, slots = await _scheduler(
            redis_url, max_staleness=1
        )  # slot i trains at v_i; 2 slots admissible at v0
        first, waiting = slots.admit(), slots.admit()
        await slots.complete(first, _group("first", first))
        scheduler.set_trainer_version(1)  # the trainer took slot 0: slot 2 (trained at v2, floor v1) is admissible
        later = slots.admit()
        await slots.wait_rewards(waiting, 0)  # its tokens are of v0: trained at v2 it would be 2 steps stale
        await slots.complete(later, _group("later", later, version=1))
        assert scheduler.stats.groups_pushed == 1 and not slots.is_pushed("later")
        assert not slots.waiting_is_stale(waiting)  # at its own slot (v1) it still trains within the bound
        await slots.complete(waiting, _group("waiting", waiting))
        assert slots.is_pushed("waiting") and slots.is_pushed("later")
        assert scheduler.stats.max_staleness_at_push == 1

    asyncio.run(scenario())


def test_a_group_waiting_for_rewards_that_is_dropped_after_a_move_releases_its_new_slot(redis_url):
    async def scenario():
        scheduler, slots = await _scheduler(redis_url)
        waiting, behind = slots.admit(), slots.admit()
        await slots.wait_rewards(waiting, 0)
        await slots.complete(behind, _group("behind", behind))
        assert slots.is_pushed("behind") and scheduler.in_flight == {behind}  # the waiting group holds slot 1
        await slots.release(behind)  # it timed out at its new slot
        assert scheduler.in_flight == set() and not slots.waiting_is_stale(behind)
        assert slots.admit() == behind  # the released slot is the next one admitted

    asyncio.run(scenario())


def test_a_restart_after_a_group_went_ahead_still_draws_the_prompts_of_own_groups_not_pushed(redis_url):
    async def scenario():
        scheduler, slots = await _scheduler(redis_url)
        waiting = slots.admit()
        before_slow = scheduler.task.cursor()
        slow, fast = scheduler.admit()[0], scheduler.admit()[0]
        await slots.wait_rewards(waiting, 0)
        await scheduler.complete(fast, _group("fast", fast))  # takes the waiting group's slot 0 and is pushed
        assert scheduler.stats.groups_pushed == 1 and scheduler.in_flight == {slow, fast}
        assert (await scheduler.queue.prompt_cursor()).position == before_slow  # slow's prompt is not lost
        await scheduler.complete(slow, _group("slow", slow))
        assert (await scheduler.queue.prompt_cursor()).position == scheduler.task.cursor()
        assert before_slow != scheduler.task.cursor()

    asyncio.run(scenario())
