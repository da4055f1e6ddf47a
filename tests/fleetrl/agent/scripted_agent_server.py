"""A scripted AgentService for the SDK's tests: a real grpc.aio server on localhost whose sessions live in
memory, which records every call (method, metadata, request) and plays injected faults.

It keeps the proto's rules the SDK relies on (bearer token, open_id and submission_id idempotency,
expected_length checks, the record read back by GetSession) and is no model of the coordinator's server:
its "model" emits ``3 + (last token + i) % 50`` at position i = 1, 2, ..., and echoes the last token at every
fourth position, so turns (and the echo reward) are predictable.
"""

from __future__ import annotations

import asyncio
import enum
import threading
import time
import uuid
from collections import defaultdict, deque
from dataclasses import dataclass, field

import grpc
import numpy as np

from protos import agent_pb2, agent_pb2_grpc, rollout_pb2

TOKEN = "test-token"
NUM_LAYERS, TOP_K = 2, 2
CHUNK_TOKENS = 2


class Fault(enum.Enum):
    UNAVAILABLE = "unavailable"  # refuse UNAVAILABLE before doing anything
    LOST_REPLY = "lost_reply"  # do the work, then fail UNAVAILABLE (Generate: after its first chunk)


@dataclass
class Exhausted:
    """Refuse RESOURCE_EXHAUSTED with ``retry-after-ms`` trailing metadata."""

    retry_after_ms: int


@dataclass
class Call:
    method: str
    metadata: dict[str, str]
    request: object
    at_s: float


@dataclass
class StoredSession:
    session_id: str
    prompt: list[int]
    group_key: str
    group_size: int = 1
    reward: float | None = None
    state: int = agent_pb2.SESSION_STATE_OPEN
    turns: list[agent_pb2.Turn] = field(default_factory=list)
    submission: tuple[str, agent_pb2.SubmitResponse] | None = None

    @property
    def length(self) -> int:
        return len(self.prompt) + sum(len(turn.token_ids) for turn in self.turns)

    def token_ids(self) -> list[int]:
        return self.prompt + [t for turn in self.turns for t in turn.token_ids]


class ScriptedAgentService(agent_pb2_grpc.AgentServiceServicer):
    def __init__(self):
        self.calls: list[Call] = []
        self.sessions: dict[str, StoredSession] = {}
        self.sessions_by_open_id: dict[str, str] = {}
        self.faults: dict[str, deque] = defaultdict(deque)
        self.policy_version = 7

    def inject(self, method: str, *faults) -> None:
        self.faults[method].extend(faults)

    def calls_of(self, method: str) -> list[Call]:
        return [call for call in self.calls if call.method == method]

    async def _enter(self, method: str, request, context) -> Fault | None:
        """Record the call, check the token, play a fault due before the work; returns one due after it."""
        metadata = {key: value for key, value in context.invocation_metadata()}
        self.calls.append(Call(method, metadata, request, time.monotonic()))
        if metadata.get("authorization") != f"Bearer {TOKEN}":
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "unknown bearer token")
        fault = self.faults[method].popleft() if self.faults[method] else None
        if fault is Fault.UNAVAILABLE:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "injected: unavailable")
        if isinstance(fault, Exhausted):
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "injected: staleness budget spent",
                trailing_metadata=(("retry-after-ms", str(fault.retry_after_ms)),),
            )
        return fault

    async def _session(self, session_id: str, context) -> StoredSession:
        session = self.sessions.get(session_id)
        if session is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"session {session_id} not found")
        return session

    async def _check_length(self, session: StoredSession, expected: int, context) -> None:
        if session.state != agent_pb2.SESSION_STATE_OPEN:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"session {session.session_id} is not open")
        if expected and expected != session.length:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"expected_length {expected} but the session holds {session.length} tokens",
            )

    async def OpenSession(self, request, context):
        fault = await self._enter("OpenSession", request, context)
        session_id = self.sessions_by_open_id.get(request.open_id)
        if session_id is None:
            session_id = uuid.uuid4().hex
            self.sessions[session_id] = StoredSession(
                session_id, list(request.prompt_token_ids), request.group_key, request.group_size
            )
            self.sessions_by_open_id[request.open_id] = session_id
        if fault is Fault.LOST_REPLY:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "injected: reply lost")
        return agent_pb2.OpenSessionResponse(
            session_id=session_id,
            policy_version=self.policy_version,
            server_id="rollout-0",
            prompt_token_ids=request.prompt_token_ids,
            max_model_len=256,
        )

    async def Generate(self, request, context):
        fault = await self._enter("Generate", request, context)
        if request.max_tokens <= 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens: must be > 0")
        session = await self._session(request.session_id, context)
        await self._check_length(session, request.expected_length, context)
        last = session.token_ids()[-1]
        tokens = [last if i % 4 == 0 else 3 + (last + i) % 50 for i in range(1, request.max_tokens + 1)]
        logprobs = [-0.5] * len(tokens)
        turn = agent_pb2.Turn(generated=True, token_ids=tokens, logprobs=logprobs, finish_reason=2)
        session.turns.append(turn)  # recorded before the reply is sent, as the real server does
        turn_index, length = len(session.turns) - 1, session.length
        start = length - len(tokens)
        span = rollout_pb2.VersionSpan(version=self.policy_version, start=0, end=len(tokens))
        experts = np.arange((length - 1) * NUM_LAYERS * TOP_K, dtype=np.int32).reshape(-1, NUM_LAYERS, TOP_K)
        routes = rollout_pb2.Tensor(data=experts.tobytes(), dtype="int32", shape=list(experts.shape))
        turn.version_spans.append(span)  # the record keeps them, as the real server's GetSession sends them
        turn.routed_experts.CopyFrom(routes)
        for begin in range(0, len(tokens), CHUNK_TOKENS):
            end = min(begin + CHUNK_TOKENS, len(tokens))
            finished = end == len(tokens)
            chunk = agent_pb2.GenerateChunk(
                token_ids=tokens[begin:end],
                logprobs=logprobs[begin:end],
                turn_index=turn_index,
                session_length=start + end,
                finished=finished,
            )
            if finished:
                chunk.finish_reason = 2  # LENGTH
                chunk.version_spans.append(span)
                chunk.routed_experts.CopyFrom(routes)
            yield chunk
            if fault is Fault.LOST_REPLY:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "injected: stream lost after the first chunk")

    async def Append(self, request, context):
        fault = await self._enter("Append", request, context)
        session = await self._session(request.session_id, context)
        await self._check_length(session, request.expected_length, context)
        session.turns.append(agent_pb2.Turn(generated=False, token_ids=request.token_ids))
        if fault is Fault.LOST_REPLY:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "injected: reply lost")
        return agent_pb2.AppendResponse(turn_index=len(session.turns) - 1, session_length=session.length)

    async def CloseSession(self, request, context):
        await self._enter("CloseSession", request, context)
        session = await self._session(request.session_id, context)
        abandoned = agent_pb2.SESSION_STATE_ABANDONED
        session.state = abandoned if request.abandon else agent_pb2.SESSION_STATE_CLOSED
        return agent_pb2.CloseSessionResponse()

    async def Submit(self, request, context):
        fault = await self._enter("Submit", request, context)
        session = await self._session(request.session_id, context)
        if session.submission is not None and session.submission[0] == request.submission_id:
            return session.submission[1]
        if request.expected_token_ids and list(request.expected_token_ids) != session.token_ids():
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "expected_token_ids: differ from the record")
        session.state = agent_pb2.SESSION_STATE_SUBMITTED
        session.reward = request.reward if request.HasField("reward") else None
        group = [s for s in self.sessions.values() if s.group_key == session.group_key]
        submitted = sum(1 for s in group if s.state == agent_pb2.SESSION_STATE_SUBMITTED)
        queued = submitted == session.group_size
        response = agent_pb2.SubmitResponse(
            group_state=agent_pb2.GROUP_STATE_QUEUED if queued else agent_pb2.GROUP_STATE_WAITING,
            sessions_submitted=submitted,
            group_size=session.group_size,
            group_id=f"group-{session.group_key}",
        )
        session.submission = (request.submission_id, response)
        if fault is Fault.LOST_REPLY:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "injected: reply lost")
        return response

    async def SetReward(self, request, context):
        await self._enter("SetReward", request, context)
        return agent_pb2.SetRewardResponse(group_state=agent_pb2.GROUP_STATE_WAITING)

    async def GetSession(self, request, context):
        await self._enter("GetSession", request, context)
        session = await self._session(request.session_id, context)
        return agent_pb2.SessionInfo(
            session_id=session.session_id,
            state=session.state,
            group_key=session.group_key,
            policy_version=self.policy_version,
            server_id="rollout-0",
            prompt_token_ids=session.prompt,
            turns=session.turns,
            session_length=session.length,
        )


class ServerThread:
    """The servicer on a grpc.aio server in a thread of its own (its own event loop), on a free port."""

    def __init__(self, servicer: ScriptedAgentService):
        self.servicer = servicer
        self.address = ""
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._serve(),), daemon=True)

    async def _serve(self) -> None:
        server = grpc.aio.server()
        agent_pb2_grpc.add_AgentServiceServicer_to_server(self.servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self._stop = asyncio.Event()
        self.address = f"127.0.0.1:{port}"
        self._started.set()
        await self._stop.wait()
        await server.stop(grace=None)

    def start(self) -> ServerThread:
        self._thread.start()
        if not self._started.wait(timeout=30):
            raise TimeoutError("the scripted agent server did not start within 30 s")
        return self

    def stop(self) -> None:
        assert self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=30)
