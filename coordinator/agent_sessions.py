"""SessionBook: external agents' sessions, their recorded tokens, and the GRPO groups they are submitted into.

The plain core of the agent API (``agent_api.py`` is its gRPC adapter). What it guarantees:

- Token truth: every token of a session is recorded here as it is generated (with its logprob and version) or
  appended (tool results, user turns). A trajectory is built from this record only; a submission carries no
  tokens to train on, so an agent cannot train on tokens it did not receive from the engine.
- Admission: the first session of a group key takes a scheduler slot (``Scheduler.admit_external``) under the
  same staleness bound as the coordinator's own groups; when none is admissible the open is refused with a retry
  delay. Every turn is generated on a server at or above the slot's version floor.
- Exactly once: a group is pushed once all its sessions are submitted with rewards, through the scheduler's
  in-order push (the queue's own exactly-once applies from there); ``open_id``, ``submission_id`` and
  ``expected_length`` make retried calls return their first answer instead of acting twice.
- Stickiness: a session generates on one server (its prefix stays in that server's cache); when the server
  fails mid-turn the turn is lost (nothing recorded) and the session moves to another server on the next turn.

Sessions live in this process: a restarted coordinator answers NOT_FOUND for the sessions it had (their groups
were never queued), and the agent starts them again.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from coordinator.agent_errors import (
    Exhausted,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unavailable,
)
from coordinator.agent_groups import AgentGroup, GroupState, SessionState, Turn, build_trajectory_group
from coordinator.fleet import NoServerAvailable
from coordinator.rollout_client import RolloutClient, RolloutFailed
from protos.config import AgentConfig
from protos.records import FinishReason

logger = logging.getLogger(__name__)

MAX_METADATA = 32
ABANDONED_BY_AGENT = "abandoned by its agent"
DEFAULT_STREAM_INTERVAL = 16  # tokens per chunk when the agent asks 0 (agent.proto GenerateRequest.stream_interval)


@dataclass
class Session:
    session_id: str
    owner: str  # the token's grant name: only it may use the session
    group: AgentGroup
    prompt: list[int]
    server: RolloutClient | None  # None after its server failed: the next turn picks another
    policy_version: int
    metadata: dict[str, str]
    turns: list[Turn] = field(default_factory=list)
    state: SessionState = SessionState.OPEN
    last_active: float = field(default_factory=time.monotonic)
    reward: float | None = None
    submission_id: str = ""
    busy: bool = False  # a turn is being generated
    open_id: str = ""  # the client's idempotency key of OpenSession

    @property
    def length(self) -> int:
        return len(self.prompt) + sum(len(t.token_ids) for t in self.turns)

    def tokens(self) -> list[int]:
        return self.prompt + [token for turn in self.turns for token in turn.token_ids]


@dataclass
class SubmitResult:
    state: GroupState
    sessions_submitted: int
    group_size: int
    group_id: str


@dataclass
class TurnChunk:
    token_ids: list[int]
    logprobs: list[float]
    turn_index: int
    session_length: int
    finished: bool = False
    turn: Turn | None = None  # the recorded turn, on the finished chunk


class SessionBook:
    """Sessions by id, open groups by (owner, group key); the scheduler admits and pushes their groups."""

    def __init__(self, config: AgentConfig, scheduler, fleet, temperature, max_model_len: int, vocab_size: int):
        self.config = config
        self.scheduler = scheduler  # coordinator.scheduler.Scheduler
        self.fleet = fleet  # coordinator.fleet.Fleet
        self.temperature = temperature  # () -> the run's sampling temperature (it can change live)
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.sessions: dict[str, Session] = {}
        self.groups: dict[tuple[str, str], AgentGroup] = {}
        self.opened: dict[tuple[str, str], str] = {}  # (owner, open_id) -> session id

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
    ) -> Session:
        if open_id and (owner, open_id) in self.opened:
            return self.sessions[self.opened[(owner, open_id)]]
        group_size = group_size or self.scheduler.config.group_size
        self._check_open(prompt, group_key, group_size, temperature, metadata)
        group = self.groups.get((owner, group_key))
        if group is not None:
            group.check_joins(prompt, group_size, temperature)
        else:
            group = self._admit_group(owner, group_key, group_size, prompt, temperature)
        floor = self.scheduler.version_floor(group.slot)
        group.opening += 1  # a concurrent open of the same group counts this one while the server is picked
        try:
            server = await self.fleet.pick(lambda c: c.policy_version >= floor, set(), 5.0, f"at v >= {floor}")
        except NoServerAvailable as error:  # nothing was recorded for this session yet
            if not group.sessions and group.opening == 1:
                await self._drop_group(group, "no server")
            raise Unavailable(f"no rollout server at policy version >= {floor}: {error}") from error
        finally:
            group.opening -= 1
        session = Session(
            uuid.uuid4().hex, owner, group, list(prompt), server, server.policy_version, dict(metadata), open_id=open_id
        )
        group.sessions[session.session_id] = session
        self.sessions[session.session_id] = session
        if open_id:
            self.opened[(owner, open_id)] = session.session_id
        return session

    def _check_open(self, prompt, group_key, group_size, temperature, metadata) -> None:
        if not prompt:
            raise InvalidArgument("prompt_token_ids: empty (a session starts from at least one token)")
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
        if sum(s.state == SessionState.OPEN for s in self.sessions.values()) >= self.config.max_sessions:
            raise Exhausted(f"{self.config.max_sessions} sessions are open (agent.max_sessions)", 1000)

    def _check_tokens(self, name: str, tokens: list[int]) -> None:
        bad = next((t for t in tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidArgument(f"{name}: token id {bad} is outside the vocabulary [0, {self.vocab_size})")

    def _admit_group(self, owner, group_key, group_size, prompt, temperature) -> AgentGroup:
        slot = self.scheduler.admit_external()
        if slot is None:
            raise Exhausted(
                f"the staleness budget is spent (trainer v{self.scheduler.trainer_version}, max_staleness "
                f"{self.scheduler.run.max_staleness}): retry later",
                self.config.admission_retry_ms,
            )
        chosen = self.temperature() if temperature is None else temperature
        group = AgentGroup(owner, group_key, group_size, list(prompt), chosen, slot, self.scheduler.trainer_version)
        self.groups[(owner, group_key)] = group
        return group

    # turns ------------------------------------------------------------------------------------------
    def get(self, owner: str, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise NotFound(f"session_id: no session {session_id!r} (unknown, expired, or the coordinator restarted)")
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
    ) -> AsyncIterator[TurnChunk]:
        """One model turn after everything the session holds; recorded only when it finished."""
        session = self._open_session(owner, session_id, expected_length)
        if max_tokens <= 0:
            raise InvalidArgument(f"max_tokens: {max_tokens}, must be > 0")
        self._check_tokens("stop_token_ids", stop_token_ids)
        room = self.max_model_len - session.length
        if room <= 0:
            raise InvalidArgument(f"session_id: the session holds {session.length} tokens = max_model_len")
        session.busy = True
        try:
            interval = stream_interval or DEFAULT_STREAM_INTERVAL
            async for chunk in self._stream_turn(session, min(max_tokens, room), stop_token_ids, interval):
                yield chunk
        finally:
            session.busy = False
            session.last_active = time.monotonic()

    async def _stream_turn(self, session: Session, max_tokens: int, stop_token_ids: list[int], stream_interval: int):
        await self._ensure_server(session)
        index, start = len(session.turns), session.length
        turn = Turn(True, [], [], server_id=session.server.server_id or session.server.address)
        request_id = f"agent-{session.session_id[:12]}-t{index}-{uuid.uuid4().hex[:6]}"
        final = None
        try:
            stream = session.server.stream_one(
                session.tokens(),
                max_tokens,
                session.group.temperature,
                stop_token_ids,
                self.scheduler.config.request_timeout_s,
                request_id,
                stream_interval,
            )
            async for chunk in stream:
                turn.token_ids += chunk.token_ids
                turn.logprobs += chunk.logprobs
                if chunk.finished:
                    final = chunk
                    break
                yield TurnChunk(list(chunk.token_ids), list(chunk.logprobs), index, start + len(turn.token_ids))
            if final is None:
                raise RolloutFailed(f"{session.server.address}: the stream ended before the turn finished")
        except RolloutFailed as error:
            self.scheduler.stats.agent_turns_lost += 1
            session.server = None  # the next turn goes to another server, with the whole history
            raise Unavailable(f"turn {index} lost ({error}); nothing was recorded: generate it again") from error
        turn.finish_reason = FinishReason(final.finish_reason)
        turn.version_spans = [(s.version, s.start, s.end) for s in final.version_spans]
        turn.routes = _routes(final)
        session.turns.append(turn)
        self.scheduler.stats.tokens_generated += len(
            turn.token_ids
        )  # the coordinator's rollout tok/s counts agents too
        yield TurnChunk(list(final.token_ids), list(final.logprobs), index, session.length, True, turn)

    async def _ensure_server(self, session: Session) -> None:
        if session.server is not None and session.server.healthy and session.server in self.fleet.clients:
            return
        floor = self.scheduler.version_floor(session.group.slot)
        try:
            session.server = await self.fleet.pick(
                lambda c: c.policy_version >= floor, set(), 10.0, f"at v >= {floor} for session {session.session_id}"
            )
        except NoServerAvailable as error:
            raise Unavailable(f"no rollout server for session {session.session_id}: {error}") from error
        logger.info("agent session %s moved to %s", session.session_id, session.server.address)

    def append(self, owner: str, session_id: str, token_ids: list[int], expected_length: int = 0) -> tuple[int, int]:
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
        session.turns.append(Turn(False, list(token_ids), [0.0] * len(token_ids)))
        return len(session.turns) - 1, session.length

    async def close(self, owner: str, session_id: str, abandon: bool) -> None:
        session = self.get(owner, session_id)
        if session.state == SessionState.SUBMITTED:
            if abandon:
                raise FailedPrecondition(f"session {session_id} is submitted; it cannot be abandoned")
            return
        if abandon:
            await self._abandon(session, ABANDONED_BY_AGENT)
        elif session.state == SessionState.OPEN:
            session.state = SessionState.CLOSED

    # submission --------------------------------------------------------------------------------------
    async def submit(
        self, owner: str, session_id: str, submission_id: str, reward: float | None, expected: list[int]
    ) -> SubmitResult:
        session = self.get(owner, session_id)
        if not submission_id:
            raise InvalidArgument("submission_id: empty (a client-chosen id makes a retried submit safe)")
        if session.state == SessionState.SUBMITTED:
            if submission_id == session.submission_id:
                return self._result(session.group)  # a retried submit: the group as it stands now
            raise FailedPrecondition(f"session {session_id} was submitted as {session.submission_id!r}")
        if session.state not in (SessionState.OPEN, SessionState.CLOSED) or session.busy:
            raise FailedPrecondition(f"session {session_id} is {session.state.name.lower()}")
        if not any(t.generated for t in session.turns):
            raise FailedPrecondition(f"session {session_id} has no generated turn to train on")
        if expected and expected != session.tokens():
            raise InvalidArgument(
                "expected_token_ids: they differ from the session's recorded tokens (only tokens the engine "
                "generated or the agent appended through this API can be submitted)"
            )
        if reward is not None and reward != reward:
            raise InvalidArgument("reward: NaN")
        session.state, session.submission_id, session.reward = SessionState.SUBMITTED, submission_id, reward
        return await self._hand_over_if_complete(session.group)

    async def set_reward(self, owner: str, session_id: str, reward: float) -> GroupState:
        session = self.get(owner, session_id)
        if session.state != SessionState.SUBMITTED:
            raise FailedPrecondition(f"session {session_id} is not submitted (submit it first)")
        if session.group.complete:
            raise FailedPrecondition(f"the group of session {session_id} is complete; its rewards are final")
        if reward != reward:
            raise InvalidArgument("reward: NaN")
        session.reward = reward
        return (await self._hand_over_if_complete(session.group)).state

    async def _hand_over_if_complete(self, group: AgentGroup) -> SubmitResult:
        submitted = group.submitted()
        if len(submitted) == group.size and all(s.reward is not None for s in submitted) and not group.complete:
            group.complete = True
            self.groups.pop((group.owner, group.key), None)
            trajectory = build_trajectory_group(group, submitted)
            group.group_id = trajectory.group_id
            await self.scheduler.complete_external(group.slot, trajectory)
        return self._result(group)

    def _result(self, group: AgentGroup) -> SubmitResult:
        if not group.complete:
            state = GroupState.WAITING
        else:
            state = GroupState.QUEUED if self.scheduler.pushed(group.group_id) else GroupState.ACCEPTED
        return SubmitResult(state, len(group.submitted()), group.size, group.group_id)

    # expiry ----------------------------------------------------------------------------------------
    async def expire(self, now: float | None = None) -> None:
        """Abandon idle sessions; drop groups that can no longer complete (called about once a second)."""
        now = time.monotonic() if now is None else now
        for session in list(self.sessions.values()):
            idle = now - session.last_active
            if session.state in (SessionState.OPEN, SessionState.CLOSED) and not session.busy:
                if idle > self.config.session_timeout_s:
                    await self._abandon(session, f"idle {idle:.0f}s")
            elif session.state in (SessionState.ABANDONED, SessionState.SUBMITTED) and session.group.done:
                self._forget(session)
        for group in list(self.groups.values()):
            if now - group.created > self.config.group_timeout_s:
                await self._drop_group(group, f"not complete after {self.config.group_timeout_s:.0f}s")

    async def _abandon(self, session: Session, why: str) -> None:
        session.state = SessionState.ABANDONED
        group = session.group
        group.sessions.pop(session.session_id, None)
        logger.info("agent session %s %s", session.session_id, why)
        if not group.complete and not group.sessions:  # nobody left in it: its slot goes to another group
            await self._drop_group(group, why if why == ABANDONED_BY_AGENT else f"every session abandoned ({why})")

    async def _drop_group(self, group: AgentGroup, why: str) -> None:
        if group.done:
            return
        group.dropped = True
        for session in list(group.sessions.values()):
            session.state = SessionState.ABANDONED
        self.groups.pop((group.owner, group.key), None)
        await self.scheduler.release_slot(group.slot)
        self.scheduler.stats.agent_groups_dropped += 1
        # an agent abandoning its own group is routine (info); a timeout or a missing server is worth a warning
        level = logging.INFO if why == ABANDONED_BY_AGENT else logging.WARNING
        logger.log(level, "agent group %r of %s dropped (%s); slot %d re-used", group.key, group.owner, why, group.slot)

    def _forget(self, session: Session) -> None:
        self.sessions.pop(session.session_id, None)
        self.opened.pop((session.owner, session.open_id), None)


def _routes(chunk):
    import numpy as np

    if not chunk.HasField("routed_experts"):
        return None
    tensor = chunk.routed_experts
    return np.frombuffer(tensor.data, dtype=tensor.dtype).reshape(tensor.shape)


def _repeated_append(session: Session, token_ids: list[int], expected_length: int) -> tuple[int, int] | None:
    """A retried append that was recorded already: (turn index, length) of the first answer, else None."""
    if not expected_length or not session.turns or session.length != expected_length + len(token_ids):
        return None
    last = session.turns[-1]
    if last.generated or last.token_ids != list(token_ids):
        return None
    return len(session.turns) - 1, session.length
