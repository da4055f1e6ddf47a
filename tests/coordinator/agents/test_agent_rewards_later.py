"""Agent groups whose sessions were submitted without rewards (set later) and the groups admitted after them: a
SessionBook over a real scheduler, a real rollout server (vLLM CPU, tiny model) and a real Redis stream.

A group waiting for its rewards holds its slot, but a complete group behind it is pushed at once while the
staleness bound holds for both; the waiting group is pushed once when its rewards are in, or dropped as stale.
"""

from __future__ import annotations

import asyncio

import pytest

from coordinator.agents.errors import FailedPrecondition
from coordinator.agents.groups import GroupState
from modeling.tiny_model import BOS_ID, DIGIT_IDS
from protos.agent_records import AgentGroupState
from protos.redis_keys import RedisKeys
from tests.coordinator.agents.agent_core import BookHarness

pytestmark = pytest.mark.integration

KEYS = RedisKeys("agent-rewards-later")
PROMPT = [BOS_ID, DIGIT_IDS[6], DIGIT_IDS[0], DIGIT_IDS[2]]
OWNER = "team-a"


def harness(rollout_server, redis_url, *overrides) -> BookHarness:
    return BookHarness(rollout_server.address, redis_url, KEYS, overrides)


async def submitted_group(book, key: str, rewards: list[float | None]) -> tuple[list, GroupState]:
    """A group of two sessions, one generated turn each, submitted with ``rewards`` (None: set later)."""
    sessions = [await book.open(OWNER, PROMPT, key, 2, None, {}) for _ in rewards]
    state = None
    for i, (session, reward) in enumerate(zip(sessions, rewards, strict=True)):
        _ = [chunk async for chunk in book.generate(OWNER, session.session_id, 4, [], session.length)]
        state = (await book.submit(OWNER, session.session_id, f"{key}-{i}", reward, [])).state
    return sessions, state


def test_a_complete_group_is_pushed_while_an_earlier_group_waits_for_its_rewards(rollout_server, redis_url):
    async def scenario():
        # one group per step, staleness 1: two slots are admissible, each trained one version apart
        async with harness(rollout_server, redis_url) as h:
            judged, state = await submitted_group(h.book, "judged-later", [None, None])
            assert state is GroupState.WAITING
            _, state = await submitted_group(h.book, "scored", [0.0, 1.0])
            assert state is GroupState.QUEUED, "the complete group waited behind the one waiting for its rewards"
            [first] = h.queued()
            assert (first.prompt_id, first.admission_index) == (f"agent:{OWNER}:scored", 0)
            assert await h.book.set_reward(OWNER, judged[0].session_id, 0.25) is GroupState.WAITING
            assert await h.book.set_reward(OWNER, judged[1].session_id, 0.75) is GroupState.QUEUED
            queued = h.queued()
            assert [g.prompt_id for g in queued] == [f"agent:{OWNER}:scored", f"agent:{OWNER}:judged-later"]
            assert [g.admission_index for g in queued] == [0, 1]  # the stream's order, as the trainer takes it
            for group in queued:  # every token was generated at v0; slot i is trained at v0 + i
                staleness = h.scheduler.train_version(group.admission_index) - min(s.min_version for s in group.samples)
                assert 0 <= staleness <= h.config.max_staleness
            assert h.scheduler.in_flight == set() and h.scheduler.stats.groups_pushed == 2

    asyncio.run(scenario())


def test_a_group_waiting_for_rewards_is_dropped_once_it_cannot_be_trained_within_the_bound(rollout_server, redis_url):
    async def scenario():
        async with harness(rollout_server, redis_url) as h:
            judged, _ = await submitted_group(h.book, "judged-later", [None, None])
            group = judged[0].group
            await h.book.expire()
            assert not group.dropped  # within the bound: it keeps its slot
            h.scheduler.set_version_offset(2)  # a restarted trainer skipped two versions: slot 0 trains at v2
            await h.book.expire()
            assert group.dropped and h.scheduler.stats.agent_groups_dropped == 1
            assert (await h.store.load()).groups[group.uid].state == AgentGroupState.DROPPED
            assert h.scheduler.in_flight == set() and h.book.slots.admit() == 0  # its slot is re-used
            with pytest.raises(FailedPrecondition):  # a reward after the drop trains nothing
                await h.book.set_reward(OWNER, judged[0].session_id, 0.5)
            assert h.queued() == []

    asyncio.run(scenario())


def test_a_group_restored_waiting_for_its_rewards_still_lets_complete_groups_go_first(rollout_server, redis_url):
    async def scenario():
        async with harness(rollout_server, redis_url) as first:
            judged, _ = await submitted_group(first.book, "judged-later", [None, None])
        async with harness(rollout_server, redis_url) as second:  # a restarted coordinator of the run
            await second.restore()
            _, state = await submitted_group(second.book, "scored", [0.0, 1.0])
            assert state is GroupState.QUEUED
            await second.book.set_reward(OWNER, judged[0].session_id, 0.25)
            assert await second.book.set_reward(OWNER, judged[1].session_id, 0.75) is GroupState.QUEUED
            queued = second.queued()
            assert [g.prompt_id for g in queued] == [f"agent:{OWNER}:scored", f"agent:{OWNER}:judged-later"]

    asyncio.run(scenario())
