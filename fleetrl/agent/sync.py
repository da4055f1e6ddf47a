"""``AgentClient`` and ``Session``: the same API as fleetrl.agent.aio, synchronously, over grpc's sync stubs
(no event loop inside; one session per thread at a time).

    with AgentClient("host:port", token) as client:
        with client.session(prompt, group_key="task-7", group_size=4) as s:
            turn = s.generate(64)
            s.submit(reward=1.0)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import grpc

from fleetrl.agent.connection import CHANNEL_OPTIONS, bearer_metadata, channel_credentials
from fleetrl.agent.errors import AgentError, FailedPrecondition, SessionLost, StreamInterrupted
from fleetrl.agent.history import TurnAssembler
from fleetrl.agent.retry import TRANSIENT_CODES, CallAttempts, RetryPolicy
from fleetrl.agent.session_core import SessionCore, SessionStatus, open_request
from fleetrl.agent.types import AppendResult, GeneratedTurn, GroupState, SubmitResult, TurnChunk, submit_result
from protos import agent_pb2, agent_pb2_grpc

logger = logging.getLogger(__name__)


class AgentClient:
    """The synchronous twin of ``AsyncAgentClient`` (same arguments, same retry and exactly-once rules)."""

    def __init__(
        self,
        address: str,
        token: str,
        *,
        tls_ca_file: str | Path | None = None,
        timeout_s: float = 120.0,
        retry: RetryPolicy | None = None,
    ):
        credentials = channel_credentials(tls_ca_file)
        if credentials is None:
            self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        else:
            self._channel = grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS)
        self._stub = agent_pb2_grpc.AgentServiceStub(self._channel)
        self._metadata = bearer_metadata(token)
        self.address = address
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def session(
        self,
        prompt_token_ids: Sequence[int] | None = None,
        *,
        group_key: str = "",
        group_size: int,
        temperature: float | None = None,
        metadata: Mapping[str, str] | None = None,
        task_id: str = "",
    ) -> SessionContext:
        """``with client.session(...) as s``: opens on entry, abandons on exit unless submitted."""
        request = open_request(
            prompt_token_ids,
            group_key=group_key,
            group_size=group_size,
            temperature=temperature,
            metadata=metadata,
            task_id=task_id,
        )
        return SessionContext(self, request)

    def open_session(
        self,
        prompt_token_ids: Sequence[int] | None = None,
        *,
        group_key: str = "",
        group_size: int,
        temperature: float | None = None,
        metadata: Mapping[str, str] | None = None,
        task_id: str = "",
    ) -> Session:
        """Open a session the caller owns (no abandon on exit: submit or abandon it yourself)."""
        request = open_request(
            prompt_token_ids,
            group_key=group_key,
            group_size=group_size,
            temperature=temperature,
            metadata=metadata,
            task_id=task_id,
        )
        return self._open(request)

    def _open(self, request: agent_pb2.OpenSessionRequest) -> Session:
        return Session(self, self._unary("OpenSession", request), request.group_key or request.task_id)

    def _unary(self, method: str, request, attempts: CallAttempts | None = None):
        rpc = getattr(self._stub, method)
        attempts = attempts or CallAttempts(self.retry, method)
        while True:
            try:
                return rpc(request, metadata=self._metadata, timeout=self.timeout_s)
            except grpc.RpcError as err:
                time.sleep(attempts.delay_after(err))


class SessionContext:
    """What ``AgentClient.session`` returns: a context manager over one session."""

    def __init__(self, client: AgentClient, request: agent_pb2.OpenSessionRequest):
        self._client = client
        self._request = request
        self._session: Session | None = None

    def __enter__(self) -> Session:
        self._session = self._client._open(self._request)
        return self._session

    def __exit__(self, exc_type, exc, tb) -> None:
        session = self._session
        if session is None or session.status in (SessionStatus.SUBMITTED, SessionStatus.ABANDONED):
            return
        try:
            session.abandon()
        except AgentError as err:
            if exc is None:
                raise
            logger.warning("abandoning session %s after %r failed: %s", session.session_id, exc, err)


class Session(SessionCore):
    """The synchronous twin of ``AsyncSession``."""

    def __init__(self, client: AgentClient, opened: agent_pb2.OpenSessionResponse, group_key: str):
        super().__init__(opened, group_key)
        self._client = client

    def generate(self, max_tokens: int, *, stop_token_ids: Sequence[int] = (), top_logprobs: int = 0) -> GeneratedTurn:
        turn = None
        for chunk in self._turn_chunks(max_tokens, stop_token_ids, restartable=True, top_logprobs=top_logprobs):
            turn = chunk.turn
        assert turn is not None  # _turn_chunks ends with the finished chunk or raises
        return turn

    def stream(
        self, max_tokens: int, *, stop_token_ids: Sequence[int] = (), top_logprobs: int = 0
    ) -> Iterator[TurnChunk]:
        return self._turn_chunks(
            max_tokens, stop_token_ids, restartable=False, stream_interval=1, top_logprobs=top_logprobs
        )

    def _turn_chunks(
        self,
        max_tokens: int,
        stop_token_ids: Sequence[int],
        restartable: bool,
        stream_interval: int = 0,
        top_logprobs: int = 0,
    ):
        self._sync_if_needed()
        request = self._generate_request(max_tokens, stop_token_ids, stream_interval, top_logprobs)
        attempts = CallAttempts(self._client.retry, "Generate")
        self._needs_sync = True
        while True:
            assembler = TurnAssembler(request.expected_length, request.top_logprobs)
            call = self._client._stub.Generate(request, metadata=self._client._metadata, timeout=self._client.timeout_s)
            try:
                for message in call:
                    chunk = assembler.add(message)
                    if chunk.turn is not None:
                        self._finish_turn(chunk.turn)
                    yield chunk
                    if chunk.turn is not None:
                        return
                raise AgentError("Generate: the stream ended without a finished chunk")
            except grpc.RpcError as err:
                failure = err
            finally:
                call.cancel()
            if assembler.token_ids and not restartable and failure.code() in TRANSIENT_CODES:
                turn = self._read_back(None)
                if turn is None:
                    raise StreamInterrupted(
                        f"Generate: the stream broke after {len(assembler.token_ids)} tokens and the server "
                        f"recorded no turn ({failure.code().name}: {failure.details()})",
                        code=failure.code(),
                        details=failure.details() or "",
                    ) from failure
                assert isinstance(turn, GeneratedTurn)
                yield assembler.remainder(turn)
                return
            try:
                delay = attempts.delay_after(failure)
            except FailedPrecondition:
                if not attempts.retried:
                    raise
                turn = self._read_back(None)
                if turn is None:
                    raise SessionLost(
                        f"Generate on session {self.session_id}: refused as a repeat ({failure.details()}) but "
                        "the server's record holds no new turn"
                    ) from failure
                assert isinstance(turn, GeneratedTurn)
                yield TurnAssembler(request.expected_length, request.top_logprobs).remainder(turn)
                return
            time.sleep(delay)

    def append(self, token_ids: Sequence[int]) -> AppendResult:
        self._sync_if_needed()
        request = self._append_request(token_ids)
        attempts = CallAttempts(self._client.retry, "Append")
        self._needs_sync = True
        try:
            response = self._client._unary("Append", request, attempts)
        except FailedPrecondition as err:
            if not attempts.retried:
                raise
            result = self._read_back(list(token_ids))
            if result is None:
                raise SessionLost(
                    f"Append on session {self.session_id}: refused as a repeat ({err.details}) but the server's "
                    "record holds no new turn"
                ) from err
            assert isinstance(result, AppendResult)
            return result
        return self._finish_append(token_ids, response)

    def submit(self, reward: float | None = None, *, expected_token_ids: Sequence[int] | None = None) -> SubmitResult:
        self._sync_if_needed()
        response = self._client._unary("Submit", self._submit_request(reward, expected_token_ids))
        self.status = SessionStatus.SUBMITTED
        return submit_result(response)

    def set_reward(self, reward: float) -> GroupState:
        request = agent_pb2.SetRewardRequest(session_id=self.session_id, reward=reward)
        return GroupState(self._client._unary("SetReward", request).group_state)

    def close(self) -> None:
        self._client._unary("CloseSession", agent_pb2.CloseSessionRequest(session_id=self.session_id))
        self.status = SessionStatus.CLOSED

    def abandon(self) -> None:
        self._client._unary("CloseSession", agent_pb2.CloseSessionRequest(session_id=self.session_id, abandon=True))
        self.status = SessionStatus.ABANDONED

    def get_info(self) -> agent_pb2.SessionInfo:
        return self._client._unary("GetSession", agent_pb2.GetSessionRequest(session_id=self.session_id))

    def _read_back(self, appended: list[int] | None) -> GeneratedTurn | AppendResult | None:
        policy = self._client.retry
        for attempt in range(policy.max_attempts):
            result = self._adopt(self.get_info(), appended)
            if result is not None:
                return result
            if attempt + 1 < policy.max_attempts:
                time.sleep(policy.backoff_s(attempt))
        return None

    def _sync_if_needed(self) -> None:
        policy = self._client.retry
        for attempt in range(policy.max_attempts if self._needs_sync else 0):
            if self._absorb(self.get_info()):
                return
            time.sleep(policy.backoff_s(attempt))
        if self._needs_sync:
            raise SessionLost(f"session {self.session_id}: the server is still generating a turn this client left")
