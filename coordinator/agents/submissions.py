"""The SessionBook's submissions (``sessions.SessionBook`` delegates to them): Submit, SetReward, and what follows
once a group's last reward is in.

A session's submission (state, submission id, reward) and, when it completes its group, the group's new state are
written in one transaction before the reply. A group whose sessions are all submitted but some rewards are still to
come (reward null, set later) tells the scheduler it waits for rewards: complete groups behind it may be pushed first
(``slots.AgentSlots``). A complete group goes to the scheduler's in-order push, unless its
rewards are all equal and the run's dynamic sampling skips it (``groups.UniformGroups``): its slot is then
released as a dropped group's. Once the scheduler has pushed a group its record says PUSHED, so a restarted
coordinator never pushes it again (``restore.restore_book``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from coordinator.agents.errors import FailedPrecondition, InvalidArgument, Unavailable
from coordinator.agents.groups import (
    AgentGroup,
    BookTables,
    GroupState,
    Session,
    SessionState,
    UniformGroups,
    build_trajectory_group,
    oldest_version,
)
from coordinator.agents.slots import AgentSlots
from coordinator.agents.store import BookRecords
from coordinator.agents.tasks import AgentTasks
from protos.agent_records import AgentGroupState

logger = logging.getLogger(__name__)


@dataclass
class SubmitResult:
    state: GroupState
    sessions_submitted: int
    group_size: int
    group_id: str


class Submissions:
    """Submit and SetReward of sessions the book looked up; ``groups`` and ``completing`` are the book's tables."""

    def __init__(
        self,
        records: BookRecords,
        tasks: AgentTasks,
        uniform: UniformGroups,
        slots: AgentSlots,
        tables: BookTables,
    ):
        self.records = records
        self.tasks = tasks
        self.uniform = uniform
        self.slots = slots
        self.groups = tables.groups
        self.completing = tables.completing

    async def submit(
        self, session: Session, submission_id: str, reward: float | None, expected: list[int]
    ) -> SubmitResult:
        session_id = session.session_id
        if not submission_id:
            raise InvalidArgument("submission_id: empty (a client-chosen id makes a retried submit safe)")
        async with session.group.lock:
            if session.state == SessionState.SUBMITTED:
                if submission_id == session.submission_id:
                    return self._result(session.group)  # a retried submit: the group as it stands now
                raise FailedPrecondition(f"session {session_id} was submitted as {session.submission_id!r}")
            if session.state not in (SessionState.OPEN, SessionState.CLOSED) or session.busy:
                raise FailedPrecondition(f"session {session_id} is {session.state.name.lower()}")
            if session.last_generated() is None:
                raise FailedPrecondition(f"session {session_id} has no generated turn to train on")
            if expected and expected != session.tokens():
                raise InvalidArgument(
                    "expected_token_ids: they differ from the session's recorded tokens (only tokens the engine "
                    "generated or the agent appended through this API can be submitted)"
                )
            if reward is not None and reward != reward:
                raise InvalidArgument("reward: NaN")
            session.busy = True  # no turn starts while the reward is computed and recorded
            try:
                if reward is None and session.group.task_prompt is not None:
                    reward = await self.tasks.score(session.group.task_prompt, session)
                changes = {"state": SessionState.SUBMITTED, "submission_id": submission_id, "reward": reward}
                await self._record_reward(session, reward, changes)
            finally:
                session.busy = False
            return self._result(session.group)

    async def set_reward(self, session: Session, reward: float) -> GroupState:
        session_id = session.session_id
        async with session.group.lock:
            if session.state != SessionState.SUBMITTED:
                raise FailedPrecondition(f"session {session_id} is not submitted (submit it first)")
            if session.group.complete:
                raise FailedPrecondition(f"the group of session {session_id} is complete; its rewards are final")
            if reward != reward:
                raise InvalidArgument("reward: NaN")
            await self._record_reward(session, reward, {"reward": reward})
            return self._result(session.group).state

    async def _record_reward(self, session: Session, reward: float | None, changes: dict) -> None:
        """Record the session's submission or reward (and its group's completion, in the same write); then hand a
        complete group to the scheduler, or release its slot when dynamic sampling skips it. Group lock held."""
        group = session.group
        others = [s.reward for s in group.submitted() if s is not session]
        complete = reward is not None and len(others) + 1 == group.size and None not in others
        rewards = [*others, reward] if complete else []
        skip = complete and self.uniform.skips(rewards)
        group_record = None
        if complete:
            group_record = self.records.group(group, AgentGroupState.SKIPPED if skip else AgentGroupState.COMPLETE)
        await self.records.write(group, session=self.records.session(session, **changes), group=group_record)
        for name, value in changes.items():
            setattr(session, name, value)
        if group_record is None:
            await self.wait_for_rewards(group)
            return
        self.groups.pop((group.owner, group.key), None)
        group.complete = True
        self.uniform.count(rewards, skip)
        if skip:
            group.skipped = True
            logger.info(
                "agent group %r of %s skipped: rewards all %.3f (dynamic sampling)", group.key, group.owner, reward
            )
            await self.slots.release(group.slot)
            return
        self.completing[group.group_id] = group
        await self.slots.complete(group.slot, build_trajectory_group(group, group.submitted()))

    async def wait_for_rewards(self, group: AgentGroup) -> None:
        """A group whose sessions are all submitted, some without a reward, has its tokens final: the scheduler may
        push complete groups behind it first, as long as it can still be trained within the staleness bound."""
        submitted = group.submitted()
        if not group.complete and len(submitted) == group.size:
            await self.slots.wait_rewards(group.slot, oldest_version(submitted))

    async def record_pushed(self, group_id: str) -> None:
        """The scheduler pushed agent group ``group_id``: record it (a restart must not push it again).

        The group leaves ``completing`` before its record is written, so the expiry loop (which retries failed
        PUSHED records) never writes it a second time concurrently; a failed write puts it back for that retry.
        """
        group = self.completing.pop(group_id, None)
        if group is None:
            return
        group.pushed = True
        try:
            await self.records.write(group, group=self.records.group(group))
        except Unavailable as error:  # the prompt cursor names it until the next push; expiry retries meanwhile
            logger.error("agent group %s pushed, its record not updated yet: %s", group_id, error)
            self.completing[group_id] = group

    def _result(self, group: AgentGroup) -> SubmitResult:
        if group.skipped:
            state = GroupState.SKIPPED
        elif not group.complete:
            state = GroupState.WAITING
        else:
            state = GroupState.QUEUED if group.pushed else GroupState.ACCEPTED
        group_id = group.group_id if group.complete else ""
        return SubmitResult(state, len(group.submitted()), group.size, group_id)
