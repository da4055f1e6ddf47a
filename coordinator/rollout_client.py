"""RolloutClient: the coordinator's gRPC client of one rollout server.

``generate`` collects the streamed chunks of every sample into finished samples; a stream that breaks
raises ``RolloutFailed`` so the scheduler can re-dispatch the whole group elsewhere.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import rollout_pb2 as pb
from protos import rollout_pb2_grpc as pb_grpc
from protos.config import SamplingConfig
from protos.records import FinishReason


class RolloutFailed(RuntimeError):
    """A Generate call failed or a server is unreachable; the work can go to another server."""


class RolloutRejected(RuntimeError):
    """The server refused the request itself (INVALID_ARGUMENT); another server would refuse it too."""


@dataclass
class SampleResult:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason = FinishReason.UNSPECIFIED
    version_spans: list[tuple[int, int, int]] = field(default_factory=list)
    routed_experts: np.ndarray | None = None


class RolloutClient:
    """One server at ``address`` ("host:port"); ``inflight`` counts this client's open calls."""

    def __init__(self, address: str):
        self.address = address
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = pb_grpc.RolloutServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.inflight = 0
        self._busy_closed_s = 0.0  # seconds with >= 1 call open, over the intervals that ended
        self._busy_since: float | None = None  # monotonic start of the interval open now
        self.requests = 0  # Generate calls sent
        self.failures = 0  # of which failed
        self.last_success_s = float("-inf")  # monotonic time the last call completed (FleetWatcher skips checks)
        self.healthy = True
        self.policy_version = 0
        self.server_id = ""
        self.tokens_per_s = 0.0  # the server's own generation rate (its window), from its last fleet report

    def busy_s(self, now: float | None = None) -> float:
        """Seconds this server had at least one Generate call of this client open (the one open now counted to
        ``now``, monotonic): how long it was generating for the coordinator (the async benchmark's rollout-busy)."""
        if self._busy_since is None:
            return self._busy_closed_s
        return self._busy_closed_s + (time.monotonic() if now is None else now) - self._busy_since

    def _open_call(self) -> None:
        if self.inflight == 0:
            self._busy_since = time.monotonic()
        self.inflight += 1
        self.requests += 1

    def _close_call(self) -> None:
        self.inflight -= 1
        if self.inflight == 0 and self._busy_since is not None:
            self._busy_closed_s += time.monotonic() - self._busy_since
            self._busy_since = None

    async def check_health(self, timeout_s: float = 2.0) -> bool:
        try:
            reply = await self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
            self.healthy = reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            self.healthy = False
        return self.healthy

    async def info(self, timeout_s: float = 5.0) -> pb.ServerInfoResponse:
        reply = await self.stub.ServerInfo(pb.ServerInfoRequest(), timeout=timeout_s)
        self.server_id = reply.server_id
        self.policy_version = reply.policy_version
        return reply

    async def generate(
        self, prompt_token_ids: list[int], n: int, sampling: SamplingConfig, timeout_s: float, request_id: str = ""
    ) -> list[SampleResult]:
        request = pb.GenerateRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling=pb.SamplingParams(
                n=n,
                max_tokens=sampling.max_tokens,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                # Whole samples are what the coordinator needs: after the first token (always sent at once) the rest of
                # a sample comes in one message. Against chunks of 16 this halved the client's CPU per call, and more
                # at 256 servers, where each connection carries a call or two and gRPC batches no reads
                # (docs/benchmarks.md, fleet scale).
                stream_interval=sampling.max_tokens,
            ),
        )
        samples = [SampleResult() for _ in range(n)]
        finished = 0
        self._open_call()
        try:
            async for chunk in self.stub.Generate(request, timeout=timeout_s):
                sample = samples[chunk.sample_index]
                sample.token_ids.extend(chunk.token_ids)
                sample.logprobs.extend(chunk.logprobs)
                if chunk.finished:
                    finished += 1
                    sample.finish_reason = FinishReason(chunk.finish_reason)  # the proto enum's values
                    sample.version_spans = [(s.version, s.start, s.end) for s in chunk.version_spans]
                    if chunk.HasField("routed_experts"):
                        tensor = chunk.routed_experts
                        sample.routed_experts = np.frombuffer(tensor.data, dtype=tensor.dtype).reshape(tensor.shape)
        except grpc.aio.AioRpcError as error:
            raise self._failure(error) from error
        finally:
            self._close_call()
        if finished != n:
            self.failures += 1
            raise RolloutFailed(f"{self.address}: stream ended with {finished} of {n} samples finished")
        self.last_success_s = time.monotonic()
        return samples

    async def stream_one(
        self,
        prompt_token_ids: list[int],
        max_tokens: int,
        temperature: float,
        stop_token_ids: list[int],
        timeout_s: float,
        request_id: str,
        stream_interval: int = 1,
        top_logprobs: int = 0,
    ):
        """One sample, streamed as the server sends it (an agent's turn): yields ``GenerateResponse`` chunks.

        Full-vocabulary sampling (top_p 1, top_k off): the trainer's logprobs are of the whole distribution.
        A broken stream raises ``RolloutFailed`` (or ``RolloutRejected`` for INVALID_ARGUMENT), as ``generate``.
        ``top_logprobs`` k > 0: each chunk also carries the k most likely tokens per new token (``top_token_ids``).
        """
        request = pb.GenerateRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling=pb.SamplingParams(
                n=1,
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=1.0,
                top_k=-1,
                stop_token_ids=stop_token_ids,
                stream_interval=stream_interval,
                logprobs=top_logprobs,
            ),
        )
        self._open_call()
        try:
            async for chunk in self.stub.Generate(request, timeout=timeout_s):
                yield chunk
        except grpc.aio.AioRpcError as error:
            raise self._failure(error) from error
        finally:
            self._close_call()
        self.last_success_s = time.monotonic()

    def _failure(self, error: grpc.aio.AioRpcError) -> RolloutFailed | RolloutRejected:
        """A failed Generate call, counted: INVALID_ARGUMENT is the request's fault, anything else the server's."""
        self.failures += 1
        if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
            return RolloutRejected(f"{self.address} refused the request: {error.details()}")
        if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN):
            self.healthy = False
        return RolloutFailed(f"{self.address}: {error.code().name}: {error.details()}")

    async def close(self) -> None:
        await self.channel.close()
