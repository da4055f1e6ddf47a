"""The agent core across a coordinator restart, in one test process: a SessionBook over a real rollout server and
Redis writes its sessions; a second book (a new scheduler, as a restarted coordinator builds it) restores them
from Redis and finishes their groups. The same module checks task sessions and dynamic sampling of agent groups,
which share its rollout server. (tests/coordinator/agents/test_agents_restart_e2e.py kills a real coordinator process.)
"""

from __future__ import annotations

import asyncio
import time

import pytest

from coordinator.agents.errors import Exhausted, InvalidArgument
from coordinator.agents.groups import GroupState
from coordinator.tasks import EchoTask
from modeling.tiny_model import BOS_ID, DIGIT_IDS
from protos.agent_records import AgentGroupState
from protos.redis_keys import RedisKeys
from tests.coordinator.agents.agent_core import BookHarness

pytestmark = pytest.mark.integration

KEYS = RedisKeys("agent-restore")
PROMPT = [BOS_ID, DIGIT_IDS[2], DIGIT_IDS[7], DIGIT_IDS[1]]
OWNER = "team-a"


def harness(rollout_server, redis_url, *overrides, pushed_before: int = 0) -> BookHarness:
    return BookHarness(rollout_server.address, redis_url, KEYS, overrides, pushed_before)


async def turn(book, session, max_tokens: int = 4):
    chunks = [c async for c in book.generate(OWNER, session.session_id, max_tokens, [], session.length)]
    return chunks[-1].turn


async def open_group(book, key: str, turns: int = 1) -> list:
    sessions = [await book.open(OWNER, PROMPT, key, 2, None, {}, open_id=f"{key}-{i}") for i in range(2)]
    for session in sessions:
        for _ in range(turns):
            await turn(book, session)
    return sessions


def test_sessions_survive_a_restart_and_their_group_is_queued_once(rollout_server, redis_url):
    async def before_the_crash():
        async with harness(rollout_server, redis_url, "max_staleness=0") as first:
            s1, s2 = await open_group(first.book, "g")
            await first.book.append(OWNER, s1.session_id, [DIGIT_IDS[5]], s1.length)
            await turn(first.book, s1)
            assert (await first.book.submit(OWNER, s1.session_id, "sub-1", 0.25, [])).state is GroupState.WAITING
            return s1, s2

    async def after_the_restart(s1, s2):
        async with harness(rollout_server, redis_url, "max_staleness=0") as second:
            await second.restore()
            assert second.scheduler.stats.slots_admitted == 1  # the group's slot, before any new admission
            r1, r2 = second.book.get(OWNER, s1.session_id), second.book.get(OWNER, s2.session_id)
            assert r1.tokens() == s1.tokens() and [t.generated for t in r1.turns] == [True, False, True]
            for mine, theirs in zip(r1.turns, s1.turns, strict=True):
                assert (mine.logprobs, mine.version_spans, mine.server_id) == (
                    theirs.logprobs,
                    theirs.version_spans,
                    theirs.server_id,
                )
            assert r2.server is not None and r2.server.address == rollout_server.address  # its affinity
            replayed_open = await second.book.open(OWNER, PROMPT, "g", 2, None, {}, open_id="g-0")
            assert replayed_open is r1
            await turn(second.book, r2)  # generation continues after the recorded history
            assert len(r2.turns) == 2 and r2.tokens()[: s2.length] == s2.tokens()
            replay = await second.book.submit(OWNER, s1.session_id, "sub-1", 0.25, [])
            assert (replay.state, replay.sessions_submitted) == (GroupState.WAITING, 1)
            done = await second.book.submit(OWNER, s2.session_id, "sub-2", 0.75, [])
            again = await second.book.submit(OWNER, s2.session_id, "sub-2", 0.75, [])
            assert done.state is again.state is GroupState.QUEUED
            [group] = second.queued()
            by_reward = {sample.reward: sample for sample in group.samples}  # the order of samples means nothing
            assert group.group_id == done.group_id and sorted(by_reward) == [0.25, 0.75]
            assert list(by_reward[0.25].response_token_ids.to_numpy()) == r1.tokens()[len(PROMPT) :]
            assert list(by_reward[0.25].loss_mask.to_numpy()).count(0) == 1  # the appended token
            with pytest.raises(Exhausted):  # the only slot of max_staleness 0 was the restored group's
                await second.book.open(OWNER, PROMPT, "another", 2, None, {})

    s1, s2 = asyncio.run(before_the_crash())
    asyncio.run(after_the_restart(s1, s2))


def test_a_group_pushed_just_before_the_crash_is_not_pushed_again(rollout_server, redis_url):
    async def before_the_crash():
        async with harness(rollout_server, redis_url) as first:
            sessions = await open_group(first.book, "g")
            for i, session in enumerate(sessions):
                result = await first.book.submit(OWNER, session.session_id, f"sub-{i}", float(i), [])
            assert result.state is GroupState.QUEUED
            group = sessions[0].group
            # the coordinator died between the push and its PUSHED record: the record still says COMPLETE
            await first.store.write(
                expire_at_s=time.time() + 600, group=first.book.records.group(group, AgentGroupState.COMPLETE)
            )
            return sessions

    async def after_the_restart(sessions):
        async with harness(rollout_server, redis_url, pushed_before=1) as second:
            await second.restore()  # the prompt cursor names the group: it was pushed
            replay = await second.book.submit(OWNER, sessions[1].session_id, "sub-1", 1.0, [])
            assert replay.state is GroupState.QUEUED and second.scheduler.stats.slots_admitted == 0
            assert len(second.queued()) == 1
            stored = await second.store.load()
            assert [g.state for g in stored.groups.values()] == [AgentGroupState.PUSHED]

    sessions = asyncio.run(before_the_crash())
    asyncio.run(after_the_restart(sessions))


def test_an_open_group_and_a_complete_one_behind_it_are_queued_in_order_after_a_restart(rollout_server, redis_url):
    async def before_the_crash():
        async with harness(rollout_server, redis_url) as first:  # max_staleness 1: two slots
            front = await open_group(first.book, "front")
            behind = await open_group(first.book, "behind")
            await first.book.submit(OWNER, front[0].session_id, "f0", 1.0, [])
            for i, session in enumerate(behind):
                result = await first.book.submit(OWNER, session.session_id, f"b{i}", float(i), [])
            assert result.state is GroupState.ACCEPTED  # complete, waiting for the front group's slot
            return front, behind

    async def after_the_restart(front, behind):
        async with harness(rollout_server, redis_url) as second:
            await second.restore()
            assert second.scheduler.stats.slots_admitted == 2 and second.queued() == []
            result = await second.book.submit(OWNER, front[1].session_id, "f1", 0.0, [])
            assert result.state is GroupState.QUEUED
            assert [g.group_id for g in second.queued()] == [front[0].group.group_id, behind[0].group.group_id]
            replay = await second.book.submit(OWNER, behind[0].session_id, "b0", 0.0, [])
            assert replay.state is GroupState.QUEUED and len(second.queued()) == 2

    front, behind = asyncio.run(before_the_crash())
    asyncio.run(after_the_restart(front, behind))


def test_a_task_session_is_scored_by_the_run_unless_its_agent_gives_the_reward(rollout_server, redis_url):
    async def scenario():
        async with harness(rollout_server, redis_url) as h:
            scored = await h.book.open(OWNER, [], "", 0, None, {}, task_id="echo-5")
            given = await h.book.open(OWNER, [], "", 0, None, {}, task_id="echo-5")  # group key: the task id
            task_prompt = EchoTask().prompt_by_id("echo-5")
            assert scored.prompt == task_prompt.prompt_token_ids and scored.group is given.group
            await turn(h.book, scored, 8)
            await h.book.append(OWNER, scored.session_id, [DIGIT_IDS[0]], scored.length)
            last = await turn(h.book, scored, 8)
            await turn(h.book, given, 8)
            await h.book.submit(OWNER, scored.session_id, "s", None, [])
            assert scored.reward == EchoTask().reward(task_prompt, last.token_ids)  # the last turn, not the first
            assert (await h.book.submit(OWNER, given.session_id, "g", 0.9, [])).state is GroupState.QUEUED
            [group] = h.queued()
            assert group.prompt_id == "echo-5" and [s.reward for s in group.samples] == [scored.reward, 0.9]
            for bad, field in [({"task_id": "echo-0"}, "task_id"), ({"task_id": "e-1", "prompt": PROMPT}, "prompt")]:
                with pytest.raises(InvalidArgument, match=f"^{field}"):
                    await h.book.open(OWNER, bad.get("prompt", []), "k", 0, None, {}, task_id=bad["task_id"])

    asyncio.run(scenario())


def test_dynamic_sampling_skips_a_uniform_agent_group_and_keeps_the_last_try(rollout_server, redis_url):
    overrides = ("max_staleness=0", "coordinator.dynamic_sampling=true", "coordinator.dynamic_sampling_max_tries=2")

    async def scenario():
        async with harness(rollout_server, redis_url, *overrides) as h:
            uniform = await open_group(h.book, "uniform")
            states = [(await h.book.submit(OWNER, s.session_id, "s", 0.5, [])).state for s in uniform]
            assert states == [GroupState.WAITING, GroupState.SKIPPED] and h.queued() == []
            stats = h.scheduler.stats
            assert (stats.groups_skipped, stats.agent_groups_dropped, stats.slots_admitted) == (1, 0, 1)
            again = await open_group(h.book, "uniform-again")  # into the released slot (max_staleness 0: one slot)
            assert stats.slots_admitted == 1
            states = [(await h.book.submit(OWNER, s.session_id, "s", 0.5, [])).state for s in again]
            assert states[-1] is GroupState.QUEUED and stats.groups_kept_uniform == 1  # the 2nd try in a row
            replay = await h.book.submit(OWNER, uniform[0].session_id, "s", 0.5, [])
            assert replay.state is GroupState.SKIPPED and len(h.queued()) == 1
            return uniform

    async def after_a_restart(uniform):
        async with harness(rollout_server, redis_url, *overrides, pushed_before=1) as h:
            await h.restore()  # the skipped group and the queued one are remembered, neither takes a slot
            replay = await h.book.submit(OWNER, uniform[1].session_id, "s", 0.5, [])
            assert replay.state is GroupState.SKIPPED and h.scheduler.stats.slots_admitted == 0
            assert len(h.queued()) == 1

    asyncio.run(after_a_restart(asyncio.run(scenario())))


def test_expiry_racing_a_push_record_neither_fails_the_submit_nor_stops_later_pushes(rollout_server, redis_url):
    """The expiry loop retries PUSHED records; it must not also write (and delete) one the push is writing now: the
    second delete raised KeyError in Submit and left the groups buffered behind it unpushed (the demo stalled)."""

    async def expire_until(done: asyncio.Event, book) -> None:
        while not done.is_set():
            await book.expire()
            await asyncio.sleep(0)  # a yield, not a wait: every await of the push's record write lets this round run

    async def scenario():
        async with harness(rollout_server, redis_url) as h:  # max_staleness 1: two slots
            front = await open_group(h.book, "front")
            behind = await open_group(h.book, "behind")
            for i, session in enumerate(behind):
                await h.book.submit(OWNER, session.session_id, f"b{i}", float(i), [])
            await h.book.submit(OWNER, front[0].session_id, "f0", 1.0, [])
            done = asyncio.Event()
            expiry = asyncio.create_task(expire_until(done, h.book))
            try:  # completes the front group: it is pushed, then the behind group, each with its PUSHED record
                result = await h.book.submit(OWNER, front[1].session_id, "f1", 0.0, [])
            finally:
                done.set()
                await expiry
            assert result.state is GroupState.QUEUED
            assert [g.group_id for g in h.queued()] == [front[0].group.group_id, behind[0].group.group_id]
            assert h.book.completing == {} and h.scheduler.in_flight == set()
            stored = await h.store.load()
            assert sorted(g.state for g in stored.groups.values()) == [AgentGroupState.PUSHED] * 2
            h.scheduler.set_trainer_version(1)  # the trainer took the front group: one more slot is admissible
            assert h.book.slots.admit() == 2

    asyncio.run(scenario())
