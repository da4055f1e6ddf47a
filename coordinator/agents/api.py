"""The agent API's gRPC adapter (protos/agent.proto): auth, request -> SessionBook call, refusal -> status.

Thin on purpose: every decision is in ``sessions.SessionBook``; this file checks the caller's token and
scope (``coordinator/auth.py``), converts messages, and maps the core's refusals to gRPC codes.
"""

from __future__ import annotations

import logging

import grpc

from coordinator.agents.errors import AgentRefused
from coordinator.agents.groups import SessionState
from coordinator.agents.sessions import SessionBook
from coordinator.auth import Authenticator, Refused, Scope, process_authenticator
from protos import agent_pb2 as pb
from protos import agent_pb2_grpc as pb_grpc
from protos import rollout_pb2 as rpb

logger = logging.getLogger(__name__)

STATUS = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "precondition": grpc.StatusCode.FAILED_PRECONDITION,
    "denied": grpc.StatusCode.PERMISSION_DENIED,
    "exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
}


async def refuse(context, error: AgentRefused) -> None:
    if error.retry_after_ms:
        context.set_trailing_metadata((("retry-after-ms", str(error.retry_after_ms)),))
    await context.abort(STATUS[error.kind], str(error))


class AgentServicer(pb_grpc.AgentServiceServicer):
    def __init__(self, book: SessionBook, auth: Authenticator):
        self.book, self.auth = book, auth

    async def OpenSession(self, request, context):
        grant = await self.auth.check(context, Scope.GENERATE)
        temperature = request.sampling.temperature if request.sampling.HasField("temperature") else None
        try:
            session = await self.book.open(
                grant.name,
                list(request.prompt_token_ids),
                request.group_key,
                request.group_size,
                temperature,
                dict(request.metadata),
                request.open_id,
                request.task_id,
            )
        except AgentRefused as error:
            await refuse(context, error)
        return pb.OpenSessionResponse(
            session_id=session.session_id,
            policy_version=session.policy_version,
            server_id=session.server.server_id if session.server else "",
            prompt_token_ids=session.prompt,
            max_model_len=self.book.max_model_len,
        )

    async def Generate(self, request, context):
        grant = await self.auth.check(context, Scope.GENERATE)
        try:
            turns = self.book.generate(
                grant.name,
                request.session_id,
                request.max_tokens,
                list(request.stop_token_ids),
                request.expected_length,
                request.stream_interval,
                request.top_logprobs,
            )
            async for chunk in turns:
                yield _chunk_message(chunk)
        except AgentRefused as error:
            await refuse(context, error)

    async def Append(self, request, context):
        grant = await self.auth.check(context, Scope.GENERATE)
        try:
            index, length = await self.book.append(
                grant.name, request.session_id, list(request.token_ids), request.expected_length
            )
        except AgentRefused as error:
            await refuse(context, error)
        return pb.AppendResponse(turn_index=index, session_length=length)

    async def CloseSession(self, request, context):
        grant = await self.auth.check(context, Scope.GENERATE)
        try:
            await self.book.close(grant.name, request.session_id, request.abandon)
        except AgentRefused as error:
            await refuse(context, error)
        return pb.CloseSessionResponse()

    async def Submit(self, request, context):
        grant = await self.auth.check(context, Scope.SUBMIT)
        reward = request.reward if request.HasField("reward") else None
        try:
            result = await self.book.submit(
                grant.name, request.session_id, request.submission_id, reward, list(request.expected_token_ids)
            )
        except AgentRefused as error:
            await refuse(context, error)
        return pb.SubmitResponse(
            group_state=int(result.state),  # GroupState values are the proto enum's
            sessions_submitted=result.sessions_submitted,
            group_size=result.group_size,
            group_id=result.group_id,
        )

    async def SetReward(self, request, context):
        grant = await self.auth.check(context, Scope.SUBMIT)
        try:
            state = await self.book.set_reward(grant.name, request.session_id, request.reward)
        except AgentRefused as error:
            await refuse(context, error)
        return pb.SetRewardResponse(group_state=int(state))

    async def GetSession(self, request, context):
        grant = await self.auth.check(context, Scope.GENERATE)
        try:
            session = self.book.get(grant.name, request.session_id)
        except AgentRefused as error:
            await refuse(context, error)
        return pb.SessionInfo(
            session_id=session.session_id,
            state=_STATES[session.state],
            group_key=session.group.key,
            policy_version=session.policy_version,
            server_id=session.server.server_id if session.server else "",
            prompt_token_ids=session.prompt,
            turns=[_turn_message(turn) for turn in session.turns],
            session_length=session.length,
        )


_STATES = {
    SessionState.OPEN: pb.SESSION_STATE_OPEN,
    SessionState.CLOSED: pb.SESSION_STATE_CLOSED,
    SessionState.SUBMITTED: pb.SESSION_STATE_SUBMITTED,
    SessionState.ABANDONED: pb.SESSION_STATE_ABANDONED,
}


def _turn_message(turn) -> pb.Turn:
    """A recorded turn as GetSession sends it: generated turns with their logprobs and version spans; the routed
    experts on the session's last generated turn only (the rows the trainer replays; earlier ones are superseded)."""
    message = pb.Turn(generated=turn.generated, token_ids=turn.token_ids, finish_reason=int(turn.finish_reason))
    if turn.generated:
        message.logprobs.extend(turn.logprobs)
        message.version_spans.extend(rpb.VersionSpan(version=v, start=s, end=e) for v, s, e in turn.version_spans)
    if turn.routes is not None:
        message.routed_experts.CopyFrom(_tensor(turn.routes))
    if turn.top_token_ids is not None:  # [T, k] row-major, as the chunks sent them
        message.top_token_ids.extend(turn.top_token_ids.ravel().tolist())
        message.top_logprobs.extend(turn.top_logprobs.ravel().tolist())
    return message


def _tensor(array) -> rpb.Tensor:
    return rpb.Tensor(data=array.tobytes(), dtype=array.dtype.name, shape=list(array.shape))


def _chunk_message(chunk) -> pb.GenerateChunk:
    message = pb.GenerateChunk(
        token_ids=chunk.token_ids,
        logprobs=chunk.logprobs,
        finished=chunk.finished,
        turn_index=chunk.turn_index,
        session_length=chunk.session_length,
    )
    if chunk.top_token_ids is not None:  # per-token rows -> row-major [new tokens, k] (agent.proto fields 9, 10)
        message.top_token_ids.extend(i for row in chunk.top_token_ids for i in row)
        message.top_logprobs.extend(lp for row in chunk.top_logprobs for lp in row)
    if chunk.finished:
        turn = chunk.turn
        message.finish_reason = int(turn.finish_reason)
        message.version_spans.extend(rpb.VersionSpan(version=v, start=s, end=e) for v, s, e in turn.version_spans)
        if turn.routes is not None:
            message.routed_experts.CopyFrom(_tensor(turn.routes))
    return message


def agent_authenticator(agent) -> Authenticator:
    """The agent API's token check (the process's one, shared with the admin API and the OpenAI door: one rate
    limit per token); it never runs open: without a tokens file it refuses to start."""
    authenticator = process_authenticator(agent)
    if authenticator is None:
        raise ValueError(
            "agent.enabled needs bearer tokens: set agent.tokens_file or FLEETRL_TOKENS_FILE (docs/auth.md)"
        )
    return authenticator


async def start_agent_server(
    book: SessionBook, auth: Authenticator, config, port: int | None = None
) -> tuple[grpc.aio.Server, int]:
    """The agent gRPC server on ``config.host`` and ``port`` (``config.port`` when None; TLS when configured);
    returns (server, port).

    Raises:
        RuntimeError: the port cannot be bound (grpc logs why; another process holding it, mostly).
    """
    from coordinator.auth import add_port

    # Without SO_REUSEPORT a port another process listens on is refused, not shared: another run's coordinator
    # on the same host must not take half of this run's agent calls (coordinator/kept_port.py).
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_AgentServiceServicer_to_server(AgentServicer(book, auth), server)
    address = f"{config.host}:{config.port if port is None else port}"
    bound = add_port(server, address, config)  # grpcio 1.85 raises RuntimeError where older versions return 0
    if not bound:
        raise RuntimeError(f"Failed to bind to address {address}")
    await server.start()
    return server, bound


HTTP_STATUS = {
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
}


def http_authorize(auth: Authenticator):
    """The OpenAI door's ``authorize(token, scope) -> grant name`` over the same token book and rate limits."""
    from coordinator.agents.door import DoorRefused

    def authorize(token: str | None, scope: str) -> str:
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        try:
            return auth.authorize(metadata, Scope(scope)).name
        except Refused as refusal:
            raise DoorRefused(
                HTTP_STATUS.get(refusal.code, 401), refusal.message, retry_after_ms=refusal.retry_after_ms
            ) from None

    return authorize
