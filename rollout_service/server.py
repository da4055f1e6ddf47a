"""gRPC adapter of the rollout server: maps RolloutService calls onto RolloutEngine.

Errors are mapped here and only here: bad input -> INVALID_ARGUMENT, too many in-flight requests ->
RESOURCE_EXHAUSTED, shutting down -> UNAVAILABLE; weight updates: wrong step order -> FAILED_PRECONDITION,
unknown version -> NOT_FOUND, publisher unreachable -> UNAVAILABLE, checksum mismatch -> DATA_LOSS.
Health checking and reflection are standard services.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos import rollout_pb2 as pb
from protos import rollout_pb2_grpc as pb_grpc
from protos.records import FinishReason
from rollout_service import metrics
from rollout_service.engine import EngineUnavailable, RequestRejected, SampleChunk
from rollout_service.engine_protocol import GenerationEngine
from rollout_service.validation import validate_generate
from rollout_service.weight_sync import UpdateConflict
from weight_bus.packing import ChecksumError
from weight_bus.tcp import WeightUnavailableError

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 8 * 1024 * 1024  # about 2M prompt tokens; larger is RESOURCE_EXHAUSTED
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["RolloutService"].full_name

# Weight-update failures -> status; order matters (ChecksumError is a ValueError, timeouts are OSErrors).
_UPDATE_ERRORS = (
    (UpdateConflict, grpc.StatusCode.FAILED_PRECONDITION),
    (LookupError, grpc.StatusCode.NOT_FOUND),
    (ChecksumError, grpc.StatusCode.DATA_LOSS),
    (WeightUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (OSError, grpc.StatusCode.UNAVAILABLE),
)
_PAUSE = {
    pb.PAUSE_MODE_UNSPECIFIED: "keep",
    pb.PAUSE_MODE_KEEP: "keep",
    pb.PAUSE_MODE_WAIT: "wait",
    pb.PAUSE_MODE_ABORT: "abort",
}


def chunk_to_proto(chunk: SampleChunk) -> pb.GenerateResponse:
    message = pb.GenerateResponse(
        request_id=chunk.request_id,
        sample_index=chunk.sample_index,
        token_ids=chunk.token_ids,
        logprobs=chunk.logprobs,
        finished=chunk.finished,
        top_token_ids=chunk.top_token_ids,
        top_logprobs=chunk.top_logprobs,
    )
    if chunk.finished:
        message.finish_reason = FinishReason.from_engine(chunk.finish_reason)  # values = the proto enum's
        message.version_spans.extend(pb.VersionSpan(version=v, start=s, end=e) for v, s, e in chunk.version_spans)
        routes = chunk.routed_experts
        if routes is not None:
            message.routed_experts.CopyFrom(
                pb.Tensor(data=routes.tobytes(), dtype=routes.dtype.name, shape=list(routes.shape))
            )
    return message


class RolloutServicer(pb_grpc.RolloutServiceServicer):
    """Thin adapter over a GenerationEngine (vLLM or the synthetic stand-in); ``follower`` (optional) performs
    UpdateWeights through the weight bus."""

    def __init__(self, engine: GenerationEngine, follower=None):
        self.engine = engine
        self.follower = follower
        self.inflight = 0
        self.paused = False
        self.draining = False  # set at shutdown: admit nothing new, let in-flight calls finish

    async def Generate(self, request, context):
        limit = self.engine.config.max_inflight_requests
        if self.draining:
            metrics.REJECTED.labels("draining").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"server {self.engine.server_id} is shutting down")
        if self.inflight >= limit:
            metrics.REJECTED.labels("busy").inc()
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.inflight} requests in flight (limit {limit})"
            )
        try:
            sampling = validate_generate(
                request,
                self.engine.vocab_size,
                self.engine.config.max_model_len,
                self.engine.config.max_samples_per_request,
            )
        except ValueError as error:
            metrics.REJECTED.labels("invalid").inc()
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
                yield chunk_to_proto(chunk)
        except RequestRejected as error:
            metrics.REJECTED.labels("invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"engine refused the request: {error}")
        except EngineUnavailable as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"server {self.engine.server_id}: {error}")
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
        _, waiting, kv_usage = self.engine.load()
        pending = self.follower.pending if self.follower is not None else None
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
            num_waiting=waiting,
            kv_cache_usage=kv_usage,
            pending_weight_version=pending.version if pending else 0,
            draining=self.draining,
            num_engine_requests=self.engine.num_unfinished(),
            last_weight_source=self.follower.last_source if self.follower is not None else "",
            last_weight_update_s=self.follower.last_update_s if self.follower is not None else 0.0,
        )

    async def _weight_step(self, context, step):
        """Run one weight-update step of the follower, mapping its failures to a status."""
        if self.follower is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "this server has no weight bus connection (--redis-url)"
            )
        try:
            return await step(self.follower)
        except Exception as error:  # noqa: BLE001 - mapped below or re-raised as INTERNAL by grpc
            for kind, code in _UPDATE_ERRORS:
                if isinstance(error, kind):
                    await context.abort(code, f"{type(error).__name__}: {error}")
            raise

    async def UpdateWeights(self, request, context):
        started = time.monotonic()
        version = await self._weight_step(context, lambda f: f.update_to(request.version))
        return pb.UpdateWeightsResponse(policy_version=version, duration_s=time.monotonic() - started)

    async def BeginWeightUpdate(self, request, context):
        pending = await self._weight_step(context, lambda f: f.begin(request.version))
        return pb.BeginWeightUpdateResponse(
            version=pending.version,
            num_bytes=sum(pending.manifest.bucket_nbytes),
            num_tensors=len(pending.manifest.tensors),
        )

    async def LoadWeights(self, request, context):
        started = time.monotonic()
        num_bytes = await self._weight_step(context, lambda f: f.load(request.version))
        return pb.LoadWeightsResponse(num_bytes=num_bytes, duration_s=time.monotonic() - started)

    async def CommitWeights(self, request, context):
        paused_s = await self._weight_step(context, lambda f: f.commit(request.version))
        return pb.CommitWeightsResponse(policy_version=self.engine.policy_version, paused_s=paused_s)

    async def AbortWeightUpdate(self, request, context):
        aborted = await self._weight_step(context, lambda f: f.abort())
        return pb.AbortWeightUpdateResponse(aborted_version=aborted)


async def start_grpc_server(
    servicer: RolloutServicer, host: str, port: int
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Start the gRPC server with health and reflection; returns (server, bound port, health servicer)."""
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
    return server, bound, health_servicer


_REFUSAL_WINDOW_S = 1.0


async def drain_and_stop(server: grpc.aio.Server, servicer: RolloutServicer, health_servicer, grace_s: float) -> None:
    """Graceful stop: NOT_SERVING, refuse new calls, give in-flight calls ``grace_s``, then cancel the rest.

    The server keeps listening while it drains so a new call gets our UNAVAILABLE "shutting down" (a client
    retries elsewhere) rather than a bare transport error. Cancelled Generate calls abort their engine
    requests (engine.generate's finally), so nothing is left running in vLLM when the engine shuts down.
    """
    servicer.draining = True
    await health_servicer.enter_graceful_shutdown()
    started = time.monotonic()
    deadline = started + grace_s
    # Listen at least a moment even with nothing in flight: a call racing the signal then meets our UNAVAILABLE
    # refusal instead of the transport's shutdown, which cancels it (the client sees CANCELLED, which reads as its
    # own cancel rather than "go elsewhere").
    refuse_until = started + min(grace_s, _REFUSAL_WINDOW_S)
    while (servicer.inflight and time.monotonic() < deadline) or time.monotonic() < refuse_until:
        await asyncio.sleep(0.05)
    if servicer.inflight:
        logger.warning("grace period over: cancelling %d calls still in flight", servicer.inflight)
    await server.stop(0)
