"""``AsyncAgentClient`` and ``AsyncSession``: the agent API over grpc.aio.

    async with AsyncAgentClient("host:port", token) as client:
        async with client.session(prompt, group_key="task-7", group_size=4) as s:
            turn = await s.generate(64, stop_token_ids=[eos])
            await s.append(tool_result_ids)
            turn = await s.generate(64)
            await s.submit(reward=1.0)

Leaving ``session()``'s block without ``submit`` (an exception included) abandons the session. Retries follow
``RetryPolicy`` (fleetrl.agent.retry); lost replies are recovered exactly-once (fleetrl.agent.history).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
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


class AsyncAgentClient:
    """A connection to the agent API; ``token`` goes as ``authorization: Bearer <token>`` on every call.

    Args:
        address: ``host:port`` of the coordinator's agent server.
        token: the bearer token (scopes ``generate`` and, to submit, ``submit``).
        tls_ca_file: PEM bundle to verify a TLS server with; None = plaintext.
        timeout_s: deadline of each attempt of a call (a Generate attempt: the whole turn).
        retry: the retry and admission-wait policy.
    """

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
            self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        else:
            self._channel = grpc.aio.secure_channel(address, credentials, options=CHANNEL_OPTIONS)
        self._stub = agent_pb2_grpc.AgentServiceStub(self._channel)
        self._metadata = bearer_metadata(token)
        self.address = address
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()

    async def __aenter__(self) -> AsyncAgentClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    def session(
        self,
        prompt_token_ids: Sequence[int] | None = None,
        *,
        group_key: str = "",
        group_size: int,
        temperature: float | None = None,
        metadata: Mapping[str, str] | None = None,
        task_id: str = "",
    ) -> AsyncSessionContext:
        """``async with client.session(...) as s``: opens on entry, abandons on exit unless submitted."""
        request = open_request(
            prompt_token_ids,
            group_key=group_key,
            group_size=group_size,
            temperature=temperature,
            metadata=metadata,
            task_id=task_id,
        )
        return AsyncSessionContext(self, request)

    async def open_session(
        self,
        prompt_token_ids: Sequence[int] | None = None,
        *,
        group_key: str = "",
        group_size: int,
        temperature: float | None = None,
        metadata: Mapping[str, str] | None = None,
        task_id: str = "",
    ) -> AsyncSession:
        """Open a session the caller owns (no abandon on exit: submit or abandon it yourself)."""
        request = open_request(
            prompt_token_ids,
            group_key=group_key,
            group_size=group_size,
            temperature=temperature,
            metadata=metadata,
            task_id=task_id,
        )
        return await self._open(request)

    async def _open(self, request: agent_pb2.OpenSessionRequest) -> AsyncSession:
        opened = await self._unary("OpenSession", request)
        return AsyncSession(self, opened, request.group_key or request.task_id)

    async def _unary(self, method: str, request, attempts: CallAttempts | None = None):
        """One unary call under the retry policy (every attempt sends the same request)."""
        rpc = getattr(self._stub, method)
        attempts = attempts or CallAttempts(self.retry, method)
        while True:
            try:
                return await rpc(request, metadata=self._metadata, timeout=self.timeout_s)
            except grpc.RpcError as err:
                await asyncio.sleep(attempts.delay_after(err))


class AsyncSessionContext:
    """What ``AsyncAgentClient.session`` returns: an async context manager over one session."""

    def __init__(self, client: AsyncAgentClient, request: agent_pb2.OpenSessionRequest):
        self._client = client
        self._request = request
        self._session: AsyncSession | None = None

    async def __aenter__(self) -> AsyncSession:
        self._session = await self._client._open(self._request)
        return self._session

    async def __aexit__(self, exc_type, exc, tb) -> None:
        session = self._session
        if session is None or session.status in (SessionStatus.SUBMITTED, SessionStatus.ABANDONED):
            return
        try:
            await session.abandon()
        except AgentError as err:
            if exc is None:
                raise
            logger.warning("abandoning session %s after %r failed: %s", session.session_id, exc, err)


class AsyncSession(SessionCore):
    """One session: its turns, appended tokens and submission. Made by ``AsyncAgentClient``."""

    def __init__(self, client: AsyncAgentClient, opened: agent_pb2.OpenSessionResponse, group_key: str):
        super().__init__(opened, group_key)
        self._client = client

    async def generate(
        self, max_tokens: int, *, stop_token_ids: Sequence[int] = (), top_logprobs: int = 0
    ) -> GeneratedTurn:
        """One model turn after everything the session holds; retried exactly-once (see module docstring)."""
        turn = None
        async for chunk in self._turn_chunks(max_tokens, stop_token_ids, restartable=True, top_logprobs=top_logprobs):
            turn = chunk.turn
        assert turn is not None  # _turn_chunks ends with the finished chunk or raises
        return turn

    def stream(
        self, max_tokens: int, *, stop_token_ids: Sequence[int] = (), top_logprobs: int = 0
    ) -> AsyncIterator[TurnChunk]:
        """One model turn as chunks of new tokens, each token as it comes; the last chunk has ``finished`` and ``turn`` set.

        A transient failure before the first chunk is retried like ``generate``; one after chunks were handed
        out is recovered from the record when the server kept the turn, else raises StreamInterrupted.
        Leaving the loop early leaves the session to resync with GetSession on its next call.
        """
        return self._turn_chunks(
            max_tokens, stop_token_ids, restartable=False, stream_interval=1, top_logprobs=top_logprobs
        )

    async def _turn_chunks(
        self,
        max_tokens: int,
        stop_token_ids: Sequence[int],
        restartable: bool,
        stream_interval: int = 0,
        top_logprobs: int = 0,
    ):
        await self._sync_if_needed()
        request = self._generate_request(max_tokens, stop_token_ids, stream_interval, top_logprobs)
        attempts = CallAttempts(self._client.retry, "Generate")
        self._needs_sync = True
        while True:
            assembler = TurnAssembler(request.expected_length, request.top_logprobs)
            call = self._client._stub.Generate(request, metadata=self._client._metadata, timeout=self._client.timeout_s)
            try:
                async for message in call:
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
                turn = await self._read_back_turn()
                if turn is None:
                    raise StreamInterrupted(
                        f"Generate: the stream broke after {len(assembler.token_ids)} tokens and the server "
                        f"recorded no turn ({failure.code().name}: {failure.details()})",
                        code=failure.code(),
                        details=failure.details() or "",
                    ) from failure
                yield assembler.remainder(turn)
                return
            try:
                delay = attempts.delay_after(failure)
            except FailedPrecondition:
                if not attempts.retried:
                    raise
                turn = await self._read_back_turn()
                if turn is None:
                    raise SessionLost(
                        f"Generate on session {self.session_id}: refused as a repeat ({failure.details()}) but "
                        "the server's record holds no new turn"
                    ) from failure
                yield TurnAssembler(request.expected_length, request.top_logprobs).remainder(turn)
                return
            await asyncio.sleep(delay)

    async def append(self, token_ids: Sequence[int]) -> AppendResult:
        """Append tokens the model did not generate (trained with mask 0); exactly-once under retries."""
        await self._sync_if_needed()
        request = self._append_request(token_ids)
        attempts = CallAttempts(self._client.retry, "Append")
        self._needs_sync = True
        try:
            response = await self._client._unary("Append", request, attempts)
        except FailedPrecondition as err:
            if not attempts.retried:
                raise
            result = await self._read_back(list(token_ids))
            if result is None:
                raise SessionLost(
                    f"Append on session {self.session_id}: refused as a repeat ({err.details}) but the server's "
                    "record holds no new turn"
                ) from err
            assert isinstance(result, AppendResult)
            return result
        return self._finish_append(token_ids, response)

    async def submit(
        self, reward: float | None = None, *, expected_token_ids: Sequence[int] | None = None
    ) -> SubmitResult:
        """Hand the session to training (reward now, or later with ``set_reward``); idempotent under retries.
        ``expected_token_ids`` (e.g. ``self.token_ids``) makes the server cross-check its record."""
        await self._sync_if_needed()
        request = self._submit_request(reward, expected_token_ids)
        response = await self._client._unary("Submit", request)
        self.status = SessionStatus.SUBMITTED
        return submit_result(response)

    async def set_reward(self, reward: float) -> GroupState:
        """Set or replace the reward of this submitted session (before its group is queued)."""
        request = agent_pb2.SetRewardRequest(session_id=self.session_id, reward=reward)
        response = await self._client._unary("SetReward", request)
        return GroupState(response.group_state)

    async def close(self) -> None:
        """Mark the session finished (no more turns); it may still be submitted."""
        await self._client._unary("CloseSession", agent_pb2.CloseSessionRequest(session_id=self.session_id))
        self.status = SessionStatus.CLOSED

    async def abandon(self) -> None:
        """Drop the session; its group slot goes to another session."""
        request = agent_pb2.CloseSessionRequest(session_id=self.session_id, abandon=True)
        await self._client._unary("CloseSession", request)
        self.status = SessionStatus.ABANDONED

    async def get_info(self) -> agent_pb2.SessionInfo:
        """The server's record of the session (GetSession)."""
        return await self._client._unary("GetSession", agent_pb2.GetSessionRequest(session_id=self.session_id))

    async def _read_back(self, appended: list[int] | None) -> GeneratedTurn | AppendResult | None:
        """Poll the record (backoff, ``max_attempts`` reads) until the unconfirmed call's turn shows."""
        policy = self._client.retry
        for attempt in range(policy.max_attempts):
            result = self._adopt(await self.get_info(), appended)
            if result is not None:
                return result
            if attempt + 1 < policy.max_attempts:
                await asyncio.sleep(policy.backoff_s(attempt))
        return None

    async def _read_back_turn(self) -> GeneratedTurn | None:
        turn = await self._read_back(None)
        assert turn is None or isinstance(turn, GeneratedTurn)
        return turn

    async def _sync_if_needed(self) -> None:
        """After an unconfirmed Generate/Append, take what the server recorded into the history."""
        policy = self._client.retry
        for attempt in range(policy.max_attempts if self._needs_sync else 0):
            if self._absorb(await self.get_info()):
                return
            await asyncio.sleep(policy.backoff_s(attempt))
        if self._needs_sync:
            raise SessionLost(f"session {self.session_id}: the server is still generating a turn this client left")
