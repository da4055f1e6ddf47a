"""SessionBook: external agents' sessions, their recorded tokens, and the GRPO groups they are submitted into.

The plain core of the agent API (``api.py`` and ``door.py`` are its adapters). What it guarantees:

- Token truth: every token of a session is recorded here as it is generated (with its logprob and version) or
  appended (tool results, user turns). A trajectory is built from this record only; a submission carries no
  tokens to train on, so an agent cannot train on tokens it did not receive from the engine.
- Admission: the first session of a group key takes a scheduler slot (``slots.AgentSlots.admit``) under the
  same staleness bound as the coordinator's own groups; when none is admissible the open is refused with a retry
  delay. Every turn is generated on a server at or above the slot's version floor.
- Exactly once: a group is pushed once all its sessions are submitted with rewards, through the scheduler's
  in-order push (the queue's own exactly-once applies from there); ``open_id``, ``submission_id`` and
  ``expected_length`` make retried calls return their first answer instead of acting twice.
- Stickiness: a session generates on one server (its prefix stays in that server's cache); when the server
  fails mid-turn the turn is lost (nothing recorded) and the session moves to another server on the next turn.
- Durability: every change is written to Redis (``store.BookRecords``) before the reply that depends on
  it, so a coordinator killed at any point and restarted serves the same sessions (``restore.restore_book``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

from channels.agent_sessions import AgentSessionStore
from coordinator.agents.errors import (
    Exhausted,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unavailable,
)
from coordinator.agents.expiry import ABANDONED_BY_AGENT, DONE_RETENTION_S, Endings
from coordinator.agents.groups import (
    AgentGroup,
    BookTables,
    GroupState,
    Session,
    SessionState,
    Turn,
    UniformGroups,
    build_trajectory_group,
)
from coordinator.agents.slots import AgentSlots
from coordinator.agents.store import BookRecords
from coordinator.agents.submissions import Submissions, SubmitResult
from coordinator.agents.tasks import AgentTasks
from coordinator.agents.turns import MAX_TOP_LOGPROBS, TurnChunk, TurnRunner
from coordinator.fleet import Fleet, NoServerAvailable
from coordinator.scheduler import Scheduler
from protos.config import AgentConfig

logger = logging.getLogger(__name__)

MAX_METADATA = 32

__all__ = ["SessionBook", "SubmitResult", "TurnChunk"]


class SessionBook:
    """Sessions by id, open groups by (owner, group key); the scheduler admits and pushes their groups through their
    slots (``slots.AgentSlots``, whose events the book takes: ``slots.SlotEvents``).

    Opening and turns are here; it delegates running turns to ``turns.TurnRunner``, submissions to
    ``submissions.Submissions`` and how sessions and groups end to ``expiry.Endings``.
    """

    def __init__(
        self,
        config: AgentConfig,
        scheduler: Scheduler,
        fleet: Fleet,
        temperature: Callable[[], float],  # the run's sampling temperature (it can change live)
        max_model_len: int,
        vocab_size: int,
        store: AgentSessionStore,
    ):
        self.config = config
        self.scheduler = scheduler
        self.fleet = fleet
        self.temperature = temperature
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.records = BookRecords(store, config, DONE_RETENTION_S)
        self.tasks = AgentTasks(scheduler.task, scheduler.stats)
        self.tables = BookTables()
        self.sessions = self.tables.sessions
        self.groups = self.tables.groups  # open groups
        self.opened = self.tables.opened
        self.completing = self.tables.completing
        self._opening: dict[tuple[str, str], asyncio.Future] = {}  # (owner, open_id) of opens in progress
        self.slots = AgentSlots(scheduler, self)  # attaches itself to the scheduler's push order
        uniform = UniformGroups(scheduler.config, scheduler.stats)
        self.submissions = Submissions(self.records, self.tasks, uniform, self.slots, self.tables)
        self.endings = Endings(config, self.records, self.slots, scheduler.stats, self.submissions, self.tables)
        self.turns = TurnRunner(scheduler, fleet, self.records)

    # opening --------------------------------------------------------------------------------------
    async def open(
        self,
        owner: str,
        prompt: list[int],
        group_key: str,
        group_size: int,
        temperature: float | None,
        metadata: dict[str, str],
        open_id: str = "",
        task_id: str = "",
    ) -> Session:
        if open_id and (owner, open_id) in self.opened:
            return self.sessions[self.opened[(owner, open_id)]]
        if open_id and (owner, open_id) in self._opening:  # a retry racing its first attempt: its answer
            return await asyncio.shield(self._opening[(owner, open_id)])
        if task_id and prompt:
            raise InvalidArgument("prompt_token_ids: give prompt_token_ids or task_id, not both")
        group_key, task_prompt = group_key or task_id, None
        group = self.groups.get((owner, group_key))
        if task_id and group is not None and group.task_id == task_id:
            prompt = group.prompt  # looked up when the group opened
        elif task_id:
            task_prompt = self.tasks.prompt(task_id)
            prompt = task_prompt.prompt_token_ids
        group_size = group_size or self.scheduler.config.group_size
        self._check_open(prompt, group_key, group_size, temperature, metadata)
        if group is not None:
            group.check_joins(prompt, group_size, temperature, task_id)
        else:
            group = self._admit_group(owner, group_key, group_size, prompt, temperature, task_id, task_prompt)
        answer = asyncio.get_running_loop().create_future()
        if open_id:
            self._opening[(owner, open_id)] = answer
        try:
            session = await self._open_in(group, owner, metadata, open_id)
            answer.set_result(session)
            return session
        except Exception as error:
            answer.set_exception(error)
            answer.exception()  # retrieved: a future nobody awaited must not warn
            raise
        finally:
            answer.cancel()  # no-op once answered; a cancelled open cancels its racing retry too
            self._opening.pop((owner, open_id), None)

    def _check_open(self, prompt, group_key, group_size, temperature, metadata) -> None:
        if not prompt:
            raise InvalidArgument("prompt_token_ids: empty (a session starts from at least one token, or a task_id)")
        self._check_tokens("prompt_token_ids", prompt)
        if len(prompt) >= self.max_model_len:
            raise InvalidArgument(f"prompt_token_ids: {len(prompt)} tokens, max_model_len is {self.max_model_len}")
        if not group_key:
            raise InvalidArgument("group_key: empty (sessions of one task share a group key)")
        run_size = self.scheduler.config.group_size  # the trainer batches groups of one size
        if group_size != run_size:
            raise InvalidArgument(f"group_size: {group_size}, this run trains groups of {run_size} (0 = the run's)")
        if temperature is not None and not temperature >= 0:
            raise InvalidArgument(f"sampling.temperature: {temperature}, must be >= 0")
        if len(metadata) > MAX_METADATA:
            raise InvalidArgument(f"metadata: {len(metadata)} entries, at most {MAX_METADATA}")
        if self._num_open() >= self.config.max_sessions:
            raise Exhausted(f"{self.config.max_sessions} sessions are open (agent.max_sessions)", 1000)

    def _num_open(self) -> int:
        """Open sessions: only open groups hold any (a group leaves ``groups`` once complete or dropped), so this
        counts the live groups' members, not every session the book still remembers (DONE_RETENTION_S)."""
        return sum(s.state == SessionState.OPEN for g in self.groups.values() for s in g.sessions.values())

    def _check_tokens(self, name: str, tokens: list[int]) -> None:
        bad = next((t for t in tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidArgument(f"{name}: token id {bad} is outside the vocabulary [0, {self.vocab_size})")

    def _admit_group(self, owner, group_key, group_size, prompt, temperature, task_id, task_prompt) -> AgentGroup:
        slot = self.slots.admit()
        if slot is None:
            raise Exhausted(
                f"the staleness budget is spent (trainer v{self.scheduler.trainer_version}, max_staleness "
                f"{self.scheduler.run.max_staleness}): retry later",
                self.config.admission_retry_ms,
            )
        chosen = self.temperature() if temperature is None else temperature
        group = AgentGroup(uuid.uuid4().hex, owner, group_key, group_size, list(prompt), chosen, slot, 0)
        group.admitted_at, group.task_id, group.task_prompt = self.scheduler.trainer_version, task_id, task_prompt
        self.groups[(owner, group_key)] = group
        return group

    async def _open_in(self, group: AgentGroup, owner: str, metadata: dict, open_id: str) -> Session:
        """Pick the session's server, record the session (and its group), then answer."""
        floor = self.scheduler.version_floor(group.slot)
        group.opening += 1  # a concurrent open of the same group counts this one while the server is picked
        try:
            server = await self.fleet.pick(lambda c: c.policy_version >= floor, set(), 5.0, f"at v >= {floor}")
        except NoServerAvailable as error:  # nothing was recorded for this session yet
            server, failure = None, error
        finally:
            group.opening -= 1
        if server is None:
            await self.endings.drop_if_empty(group, "no server")
            raise Unavailable(f"no rollout server at policy version >= {floor}: {failure}") from failure
        session_id = uuid.uuid4().hex
        session = Session(session_id, owner, group, list(group.prompt), server, server.policy_version, dict(metadata))
        session.open_id = open_id
        async with group.lock:
            if group.done:
                raise Unavailable(f"group {group.key!r} was dropped while this session opened: open it again")
            try:
                await self.records.write(group, group=self.records.group(group), session=self.records.session(session))
            except Unavailable:
                await self.endings.drop_if_empty(group, "its first session could not be recorded", locked=True)
                raise
            group.sessions[session_id] = session
            self.adopt(session)
        return session

    def adopt(self, session: Session) -> None:
        """Take a session into the book (a new one, or one restored from its record)."""
        self.sessions[session.session_id] = session
        if session.state != SessionState.ABANDONED:
            session.group.sessions[session.session_id] = session
        if session.open_id:
            self.opened[(session.owner, session.open_id)] = session.session_id
        session.group.remembered += 1

    async def resume_group(self, group: AgentGroup) -> None:
        """A restored group with its new slot: open again, or handed to the scheduler when it was complete."""
        submitted = group.submitted()
        if not group.complete:
            self.groups[(group.owner, group.key)] = group
            await self.submissions.wait_for_rewards(group)
        elif len(submitted) == group.size and all(s.reward is not None for s in submitted):
            self.completing[group.group_id] = group
            await self.slots.complete(group.slot, build_trajectory_group(group, submitted))
        else:  # not written this way by any coordinator: refuse to train it rather than guess
            group.complete = False
            await self.endings.drop_group(group, f"its record is complete but {len(submitted)} sessions were submitted")

    # slots.SlotEvents ------------------------------------------------------------------------------------------
    def group_moved(self, old_slot: int, new_slot: int) -> None:
        """The scheduler pushed a complete group ahead of the group waiting for rewards at ``old_slot``, which takes
        ``new_slot``: it is completed or dropped there."""
        group = next(g for g in self.groups.values() if g.slot == old_slot and not g.done)
        group.slot = new_slot

    async def group_pushed(self, group_id: str) -> None:
        """The scheduler pushed agent group ``group_id``: recorded, so a restart never pushes it again."""
        await self.submissions.record_pushed(group_id)

    # turns ------------------------------------------------------------------------------------------
    def get(self, owner: str, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise NotFound(f"session_id: no session {session_id!r} (unknown, or expired)")
        if session.owner != owner:
            raise PermissionDenied(f"session {session_id} belongs to another token")
        return session

    def _open_session(self, owner: str, session_id: str, expected_length: int) -> Session:
        session = self.get(owner, session_id)
        if session.state != SessionState.OPEN:
            raise FailedPrecondition(f"session {session_id} is {session.state.name.lower()}")
        if session.busy:
            raise FailedPrecondition(f"session {session_id} is generating a turn already")
        if expected_length and expected_length != session.length:
            raise FailedPrecondition(
                f"expected_length: the session holds {session.length} tokens, the call expected {expected_length} "
                "(GetSession to resync)"
            )
        session.last_active = time.monotonic()
        return session

    async def generate(
        self,
        owner: str,
        session_id: str,
        max_tokens: int,
        stop_token_ids: list[int],
        expected_length: int = 0,
        stream_interval: int = 0,
        top_logprobs: int = 0,
    ) -> AsyncIterator[TurnChunk]:
        """One model turn after everything the session holds; recorded (in Redis too) before its last chunk.
        ``top_logprobs`` k > 0: every chunk and the recorded turn carry the engine's k most likely tokens per token."""
        session = self._open_session(owner, session_id, expected_length)
        if max_tokens <= 0:
            raise InvalidArgument(f"max_tokens: {max_tokens}, must be > 0")
        if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgument(f"top_logprobs: {top_logprobs}, must be in [0, {MAX_TOP_LOGPROBS}]")
        self._check_tokens("stop_token_ids", stop_token_ids)
        room = self.max_model_len - session.length
        if room <= 0:
            raise InvalidArgument(f"session_id: the session holds {session.length} tokens = max_model_len")
        session.busy = True
        try:
            chunks = self.turns.stream(session, min(max_tokens, room), stop_token_ids, stream_interval, top_logprobs)
            async for chunk in chunks:
                yield chunk
        finally:
            session.busy = False
            session.last_active = time.monotonic()

    async def append(self, owner: str, session_id: str, token_ids: list[int], expected_length: int = 0):
        """Record tokens the model did not generate; returns (turn index, session length)."""
        session = self.get(owner, session_id)
        repeat = _repeated_append(session, token_ids, expected_length)
        if repeat is not None:
            return repeat
        session = self._open_session(owner, session_id, expected_length)
        if not token_ids:
            raise InvalidArgument("token_ids: empty (append at least one token)")
        self._check_tokens("token_ids", token_ids)
        if session.length + len(token_ids) > self.max_model_len:
            raise InvalidArgument(
                f"token_ids: {session.length} + {len(token_ids)} tokens exceed max_model_len {self.max_model_len}"
            )
        turn = Turn(False, list(token_ids), [0.0] * len(token_ids))
        session.busy = True
        try:
            await self.records.write_turn(session, len(session.turns), turn)
        finally:
            session.busy = False
        session.turns.append(turn)
        return len(session.turns) - 1, session.length

    async def close(self, owner: str, session_id: str, abandon: bool) -> None:
        session = self.get(owner, session_id)
        async with session.group.lock:
            if session.state == SessionState.SUBMITTED:
                if abandon:
                    raise FailedPrecondition(f"session {session_id} is submitted; it cannot be abandoned")
                return
            if abandon and session.state != SessionState.ABANDONED:
                await self.endings.abandon_session(session, ABANDONED_BY_AGENT)
            elif not abandon and session.state == SessionState.OPEN:
                await self.records.write(
                    session.group, session=self.records.session(session, state=SessionState.CLOSED)
                )
                session.state = SessionState.CLOSED

    # submissions and endings (submissions.Submissions, expiry.Endings) -----------------------------------------
    async def submit(
        self, owner: str, session_id: str, submission_id: str, reward: float | None, expected: list[int]
    ) -> SubmitResult:
        return await self.submissions.submit(self.get(owner, session_id), submission_id, reward, expected)

    async def set_reward(self, owner: str, session_id: str, reward: float) -> GroupState:
        return await self.submissions.set_reward(self.get(owner, session_id), reward)

    async def expire(self, now: float | None = None) -> None:
        """Abandon idle sessions, drop groups that can no longer complete, forget what is done (about once a
        second)."""
        await self.endings.expire(now)


def _repeated_append(session: Session, token_ids: list[int], expected_length: int) -> tuple[int, int] | None:
    """A retried append that was recorded already: (turn index, length) of the first answer, else None."""
    if not expected_length or not session.turns or session.length != expected_length + len(token_ids):
        return None
    last = session.turns[-1]
    if last.generated or last.token_ids != list(token_ids):
        return None
    return len(session.turns) - 1, session.length
