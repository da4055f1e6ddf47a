"""The part of a session that does not depend on the transport: its identity, its token history, the
requests it sends and how it adopts a turn the server recorded while the reply was lost.

``AsyncSession`` (fleetrl.agent.aio) and ``Session`` (fleetrl.agent.sync) subclass it and only add the calls.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Mapping, Sequence

from fleetrl.agent.errors import AgentError, SessionLost
from fleetrl.agent.history import SessionHistory, recovered_turn
from fleetrl.agent.types import AppendResult, FinishReason, GeneratedTurn
from protos import agent_pb2


class SessionStatus(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"  # finished (CloseSession abandon=false), may still be submitted
    SUBMITTED = "submitted"
    ABANDONED = "abandoned"


def open_request(
    prompt_token_ids: Sequence[int] | None,
    *,
    group_key: str,
    group_size: int,
    temperature: float | None,
    metadata: Mapping[str, str] | None,
    task_id: str,
) -> agent_pb2.OpenSessionRequest:
    """The OpenSession request, with a fresh ``open_id`` that every retry of it reuses."""
    if not prompt_token_ids and not task_id:
        raise ValueError("session(): give prompt_token_ids or task_id")
    if not group_key and not task_id:
        raise ValueError("session(): give group_key (the sessions of one task share it; a task_id's is the task id)")
    if group_size < 1:
        raise ValueError(f"session(): group_size must be >= 1, got {group_size}")
    sampling = agent_pb2.SessionSampling()
    if temperature is not None:
        sampling.temperature = temperature
    return agent_pb2.OpenSessionRequest(
        prompt_token_ids=list(prompt_token_ids or ()),
        group_key=group_key,
        group_size=group_size,
        sampling=sampling,
        metadata=dict(metadata or {}),
        task_id=task_id,
        open_id=uuid.uuid4().hex,
    )


class SessionCore:
    """Identity, status and token history of one session."""

    def __init__(self, opened: agent_pb2.OpenSessionResponse, group_key: str):
        self.session_id = opened.session_id
        self.group_key = group_key
        self.policy_version = opened.policy_version
        self.server_id = opened.server_id
        self.max_model_len = opened.max_model_len
        self.status = SessionStatus.OPEN
        self._history = SessionHistory(list(opened.prompt_token_ids))
        self._submission_id = uuid.uuid4().hex  # one per session: a repeated Submit returns the first answer
        # True while a Generate/Append is unconfirmed (in flight, failed, or a stream left early): the next call
        # first reads the record back, so the history never silently misses a turn.
        self._needs_sync = False

    @property
    def prompt_token_ids(self) -> list[int]:
        return list(self._history.prompt_token_ids)

    @property
    def token_ids(self) -> list[int]:
        """Prompt and every turn, as the session holds them (Submit's ``expected_token_ids``)."""
        return self._history.token_ids

    @property
    def length(self) -> int:
        return self._history.length

    @property
    def num_turns(self) -> int:
        return len(self._history.turns)

    def _check_open(self, method: str) -> None:
        if self.status is not SessionStatus.OPEN:
            raise AgentError(f"{method}: session {self.session_id} is {self.status.value}")

    def _generate_request(
        self, max_tokens: int, stop_token_ids: Sequence[int], stream_interval: int = 0, top_logprobs: int = 0
    ) -> agent_pb2.GenerateRequest:
        self._check_open("Generate")
        if top_logprobs < 0:  # the field is unsigned; the server checks the upper bound (INVALID_ARGUMENT)
            raise ValueError(f"generate(): top_logprobs must be >= 0, got {top_logprobs}")
        return agent_pb2.GenerateRequest(
            session_id=self.session_id,
            max_tokens=max_tokens,
            stop_token_ids=list(stop_token_ids),
            expected_length=self._history.length,
            stream_interval=stream_interval,
            top_logprobs=top_logprobs,
        )

    def _append_request(self, token_ids: Sequence[int]) -> agent_pb2.AppendRequest:
        self._check_open("Append")
        if not token_ids:
            raise ValueError("append(): token_ids must hold at least one token")
        return agent_pb2.AppendRequest(
            session_id=self.session_id, token_ids=list(token_ids), expected_length=self._history.length
        )

    def _submit_request(self, reward: float | None, expected_token_ids: Sequence[int] | None):
        if self.status is SessionStatus.ABANDONED:
            raise AgentError(f"Submit: session {self.session_id} was abandoned")
        request = agent_pb2.SubmitRequest(
            session_id=self.session_id,
            submission_id=self._submission_id,
            expected_token_ids=list(expected_token_ids or ()),
        )
        if reward is not None:
            request.reward = reward
        return request

    def _finish_turn(self, turn: GeneratedTurn) -> GeneratedTurn:
        self._history.add(True, turn.token_ids, turn.session_length)
        self._needs_sync = False
        return turn

    def _finish_append(self, token_ids: Sequence[int], response: agent_pb2.AppendResponse) -> AppendResult:
        self._history.add(False, list(token_ids), response.session_length)
        self._needs_sync = False
        return AppendResult(response.turn_index, response.session_length)

    def _absorb(self, info: agent_pb2.SessionInfo) -> bool:
        """Take the record read back after an unconfirmed call into the history: True once they agree, False
        while the record's new turn is still being generated."""
        extra = self._history.extra_turn(info)
        if extra is not None:
            if _in_progress(extra):
                return False
            self._history.add(extra.generated, list(extra.token_ids), info.session_length)
        elif info.session_length and info.session_length != self._history.length:
            raise SessionLost(
                f"session {self.session_id}: the server holds {info.session_length} tokens, "
                f"the client {self._history.length}"
            )
        self._needs_sync = False
        return True

    def _adopt(
        self, info: agent_pb2.SessionInfo, appended: Sequence[int] | None
    ) -> GeneratedTurn | AppendResult | None:
        """The answer of a Generate (``appended`` None) or Append whose reply was lost, read from the record.

        Returns None while the record holds no finished turn beyond the history; SessionLost when its new turn
        is not the one this call made.
        """
        extra = self._history.extra_turn(info)
        if extra is None or _in_progress(extra):
            return None
        if appended is None and not extra.generated:
            raise SessionLost(f"session {self.session_id}: the server recorded an appended turn, not a generated one")
        if appended is not None and (extra.generated or list(extra.token_ids) != list(appended)):
            raise SessionLost(f"session {self.session_id}: the server's new turn is not the tokens appended")
        turn_index = self.num_turns
        self._history.add(extra.generated, list(extra.token_ids), info.session_length)
        self._needs_sync = False
        if appended is None:
            return recovered_turn(extra, turn_index, self._history.length)
        return AppendResult(turn_index, self._history.length)


def _in_progress(turn: agent_pb2.Turn) -> bool:
    """A generated turn with no finish reason yet is still being generated (the record shows it growing)."""
    return turn.generated and turn.finish_reason == FinishReason.UNSPECIFIED
