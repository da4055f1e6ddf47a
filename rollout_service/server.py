"""gRPC adapter of the rollout server: maps RolloutService calls onto RolloutEngine.

Errors are mapped here and only here: bad input -> INVALID_ARGUMENT, too many in-flight requests ->
RESOURCE_EXHAUSTED, engine failure -> INTERNAL. Health checking and reflection are standard services.
"""

from __future__ import annotations

import json
import logging
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos import rollout_pb2 as pb
from protos import rollout_pb2_grpc as pb_grpc
from rollout_service import metrics
from rollout_service.engine import RolloutEngine, SampleChunk
from rollout_service.validation import validate_generate

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 8 * 1024 * 1024  # about 2M prompt tokens; larger is RESOURCE_EXHAUSTED
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["RolloutService"].full_name

_FINISH = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "error": pb.FINISH_REASON_ERROR,
}
_PAUSE = {pb.PAUSE_MODE_UNSPECIFIED: "keep", pb.PAUSE_MODE_KEEP: "keep", pb.PAUSE_MODE_WAIT: "wait", pb.PAUSE_MODE_ABORT: "abort"}


def chunk_to_proto(chunk: SampleChunk) -> pb.GenerateResponse:
    message = pb.GenerateResponse(
        request_id=chunk.request_id,
        sample_index=chunk.sample_index,
        token_ids=chunk.token_ids,
        logprobs=chunk.logprobs,
        finished=chunk.finished,
    )
    if chunk.finished:
        message.finish_reason = _FINISH.get(chunk.finish_reason or "", pb.FINISH_REASON_UNSPECIFIED)
        message.version_spans.extend(pb.VersionSpan(version=v, start=s, end=e) for v, s, e in chunk.version_spans)
        routes = chunk.routed_experts
        if routes is not None:
            message.routed_experts.CopyFrom(
                pb.Tensor(data=routes.tobytes(), dtype=routes.dtype.name, shape=list(routes.shape))
            )
    return message


class RolloutServicer(pb_grpc.RolloutServiceServicer):
    """Thin adapter; ``follower`` (optional) performs UpdateWeights through the weight bus."""

    def __init__(self, engine: RolloutEngine, follower=None):
        self.engine = engine
        self.follower = follower
        self.inflight = 0
        self.paused = False

    async def Generate(self, request, context):
        limit = self.engine.config.max_inflight_requests
        if self.inflight >= limit:
            metrics.REJECTED.inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.inflight} requests in flight (limit {limit})")
        try:
            sampling = validate_generate(
                request, self.engine.vocab_size, self.engine.config.max_model_len,
                self.engine.config.max_samples_per_request,
            )
        except ValueError as error:
            metrics.REJECTED.inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        self.inflight += 1
        metrics.RUNNING.set(self.inflight)
        started = time.monotonic()
        first = True
        try:
            async for chunk in self.engine.generate(sampling):
                if first:
                    metrics.TTFT.observe(time.monotonic() - started)
                    first = False
                metrics.TOKENS.inc(len(chunk.token_ids))
                yield chunk_to_proto(chunk)
        finally:
            self.inflight -= 1
            metrics.RUNNING.set(self.inflight)

    async def Abort(self, request, context):
        await self.engine.abort(list(request.request_ids))
        return pb.AbortResponse(num_aborted=len(request.request_ids))

    async def Pause(self, request, context):
        if request.mode not in _PAUSE:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"mode {request.mode} is not a PauseMode")
        await self.engine.pause(_PAUSE[request.mode])
        self.paused = True
        return pb.PauseResponse()

    async def Resume(self, request, context):
        await self.engine.resume()
        self.paused = False
        return pb.ResumeResponse()

    async def ServerInfo(self, request, context):
        config = self.engine.config
        return pb.ServerInfoResponse(
            server_id=self.engine.server_id,
            model=self.engine.model_path,
            vocab_size=self.engine.vocab_size,
            max_model_len=config.max_model_len,
            policy_version=self.engine.policy_version,
            routed_experts_available=self.engine.routed_experts_available,
            num_running=self.inflight,
            paused=self.paused,
            engine_config_json=json.dumps(config.model_dump()),
            max_inflight_requests=config.max_inflight_requests,
        )

    async def UpdateWeights(self, request, context):
        if self.follower is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this server has no weight bus connection")
        started = time.monotonic()
        try:
            version = await self.follower.update_to(request.version)
        except LookupError as error:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(error))
        metrics.UPDATE_SECONDS.observe(time.monotonic() - started)
        metrics.POLICY_VERSION.set(version)
        return pb.UpdateWeightsResponse(policy_version=version, duration_s=time.monotonic() - started)


async def start_grpc_server(servicer: RolloutServicer, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Start the gRPC server with health and reflection; returns (server, bound port)."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ]
    )
    pb_grpc.add_RolloutServiceServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, bound
