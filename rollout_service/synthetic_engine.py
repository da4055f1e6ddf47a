"""SyntheticEngine: a stand-in for the vLLM engine that emits seeded random tokens at a configured rate.

Behind the real servicer (``server.py``) it serves the real gRPC API: validation, backpressure, health, version
reports and the weight follower all run unchanged. It imports no vLLM and holds no model, so one process can host
hundreds of servers (``standin_fleet.py``) for coordinator benchmarks and tests.

What it produces (``rollout.synthetic``, ``SyntheticEngineConfig``):

* tokens: ids in ``[0, vocab_size)`` and logprobs ``log(U)``, U uniform in (0, 1], from a generator seeded by
  ``rollout.seed``, the request's seed (else the prompt) and the sample index: the same request gets the same
  samples on any stand-in with the same ``rollout.seed``. A sample ends at ``max_tokens`` (``length``) or at a
  drawn stop token id (``stop``); there is no EOS.
* pace: samples decode side by side, each at ``tokens_per_s`` (0 = as fast as the event loop goes), all of a
  server's requests within ``server_tokens_per_s`` (0 = no cap), after ``first_token_s`` of "prefill".
* chunks: the first token alone, then ``max(request interval, rollout.stream_interval)`` tokens, as vLLM streams.
* versions: every token carries the version in force when it is emitted; a commit pauses generation (``commit_s``),
  labels the new version and resumes, without loading any bytes (``loads_weight_bytes`` is False, so the weight
  follower fetches none), so the coordinator sees a fleet moving through versions as with real weights.
* routes: with ``moe_layers`` > 0, finished samples carry int32 routes ``[prompt + T - 1, moe_layers, moe_top_k]``
  of distinct expert ids, the shape vLLM returns.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np

from protos.config import RolloutConfig
from rollout_service import metrics
from rollout_service.engine import RequestRejected, SampleChunk, SamplingRequest

logger = logging.getLogger(__name__)


@dataclass
class _Sample:
    """One sample's pre-drawn tokens and how far it has been streamed."""

    token_ids: np.ndarray  # int32 [length]; the last one is the stop token when finish_reason is "stop"
    logprobs: np.ndarray  # float32 [length]
    finish_reason: str  # what ends it once every token is out: "stop" | "length"
    sent: int = 0
    spans: list[list[int]] = field(default_factory=list)  # [version, start, end]
    aborted: bool = False  # set before its last token: its next chunk ends it with finish reason "abort"
    closed: bool = False  # its finished chunk went out

    @property
    def emitting(self) -> bool:
        return not (self.closed or self.aborted)

    def take(self, count: int, version: int) -> tuple[list[int], list[float]]:
        start, end = self.sent, min(self.sent + count, len(self.token_ids))
        self.sent = end
        if self.spans and self.spans[-1][0] == version:
            self.spans[-1][2] = end
        else:
            self.spans.append([version, start, end])
        return self.token_ids[start:end].tolist(), self.logprobs[start:end].tolist()


class SyntheticEngine:
    """The stand-in engine of one server (``rollout.engine=synthetic``); see the module docstring."""

    loads_weight_bytes = False

    def __init__(self, model_path: str, config: RolloutConfig, server_id: str = ""):
        self.model_path = model_path or "synthetic"
        self.config = config
        self.settings = config.synthetic
        self.server_id = server_id or f"standin-{uuid.uuid4().hex[:8]}"
        self.policy_version = 0
        self.vocab_size = self.settings.vocab_size
        self.routed_experts_available = self.settings.moe_layers > 0
        self.held_by_operator = False
        self.last_load_s = 0.0  # no weights are ever loaded
        self.last_commit_paused = False  # every commit pauses the stand-in (set by the first)
        self._admitting = asyncio.Event()  # cleared by any pause: new requests wait
        self._running = asyncio.Event()  # cleared by pause(keep|abort) and commits: no token is emitted
        self._admitting.set()
        self._running.set()
        self._update_lock = asyncio.Lock()
        self._live: dict[str, list[_Sample]] = {}
        self._num_waiting = 0
        self._server_free_at = 0.0  # loop time at which the server's token budget (server_tokens_per_s) is free

    async def start(self) -> None:
        logger.info(
            "synthetic engine %s up (vocab %d, %.0f tokens/s per sample)",
            self.server_id,
            self.vocab_size,
            self.settings.tokens_per_s,
        )

    def load(self) -> tuple[int, int, float]:
        return len(self._live), self._num_waiting, 0.0

    def num_unfinished(self) -> int:
        return len(self._live)

    @property
    def errored(self) -> bool:
        return False  # nothing can die underneath it

    async def ipc_unopenable_reason(self, record_bytes: bytes) -> str:
        return "the synthetic engine loads no weights"

    # generation ---------------------------------------------------------------------------
    async def generate(self, request: SamplingRequest) -> AsyncIterator[SampleChunk]:
        """Stream every sample's chunks at the configured pace; aborted samples end with finish reason ``abort``."""
        request_id = request.request_id or uuid.uuid4().hex
        if request.logprobs:  # its tokens are drawn, not sampled from a distribution: it has no alternatives to rank
            raise RequestRejected("sampling.logprobs: the synthetic engine has no top logprobs (ask for 0)")
        await self._wait_admitted()
        if request_id in self._live:
            raise RequestRejected(f"request_id {request_id!r} is already running on {self.server_id}")
        samples = [self._draw(request, index) for index in range(request.n)]
        self._live[request_id] = samples
        try:
            loop = asyncio.get_running_loop()
            started = loop.time() + self.settings.first_token_s
            interval = max(request.stream_interval, self.config.stream_interval)
            step, streamed = 1, 0  # the first token goes out alone, as vLLM streams
            while not all(sample.closed for sample in samples):
                streamed += step
                await self._pace(loop, started, streamed, step * sum(s.emitting for s in samples))
                await self._running.wait()
                for index, sample in enumerate(samples):
                    chunk = self._next_chunk(request, request_id, index, sample, step)
                    if chunk is not None:
                        yield chunk
                step = interval
        finally:
            del self._live[request_id]

    async def _wait_admitted(self) -> None:
        if self._admitting.is_set():
            return
        self._num_waiting += 1
        try:
            await self._admitting.wait()
        finally:
            self._num_waiting -= 1

    async def _pace(self, loop, started: float, streamed: int, num_tokens: int) -> None:
        """Sleep until ``streamed`` tokens per sample are due (from ``started``) and the server's budget allows."""
        settings = self.settings
        due = started + (streamed / settings.tokens_per_s if settings.tokens_per_s else 0.0)
        if settings.server_tokens_per_s:
            free_at = max(loop.time(), self._server_free_at) + num_tokens / settings.server_tokens_per_s
            self._server_free_at = free_at
            due = max(due, free_at)
        await asyncio.sleep(max(0.0, due - loop.time()))  # sleep(0) still yields to the loop

    def _next_chunk(
        self, request: SamplingRequest, request_id: str, index: int, sample: _Sample, step: int
    ) -> SampleChunk | None:
        if sample.closed:
            return None
        if sample.aborted:
            sample.closed = True
            chunk = SampleChunk(request_id, index, [], [], finished=True, finish_reason="abort")
            chunk.version_spans = [tuple(span) for span in sample.spans]
            return chunk
        token_ids, logprobs = sample.take(step, self.policy_version)
        metrics.count_generated(len(token_ids))  # a paced chunk is this engine's step
        chunk = SampleChunk(request_id, index, token_ids, logprobs)
        if sample.sent >= len(sample.token_ids):
            sample.closed = True
            chunk.finished = True
            chunk.finish_reason = sample.finish_reason
            chunk.version_spans = [tuple(span) for span in sample.spans]
            if self.routed_experts_available:
                chunk.routed_experts = self._routes(request, index, len(sample.token_ids))
        return chunk

    def _seed(self, request: SamplingRequest, index: int) -> list[int]:
        request_seed = (
            request.seed
            if request.seed is not None
            else zlib.crc32(np.asarray(request.prompt_token_ids, dtype=np.int64).tobytes())
        )
        return [self.config.seed & 0xFFFFFFFF, request_seed & 0xFFFFFFFFFFFFFFFF, index]

    def _draw(self, request: SamplingRequest, index: int) -> _Sample:
        rng = np.random.default_rng(self._seed(request, index))
        token_ids = rng.integers(0, self.vocab_size, size=request.max_tokens, dtype=np.int32)
        logprobs = np.log1p(-rng.random(request.max_tokens)).astype(np.float32)  # log(U), U in (0, 1]
        finish_reason = "length"
        if request.stop_token_ids:
            stops = np.flatnonzero(np.isin(token_ids, request.stop_token_ids))
            if stops.size:
                end = int(stops[0]) + 1
                token_ids, logprobs, finish_reason = token_ids[:end], logprobs[:end], "stop"
        return _Sample(token_ids, logprobs, finish_reason)

    def _routes(self, request: SamplingRequest, index: int, num_response: int) -> np.ndarray:
        settings = self.settings
        rng = np.random.default_rng([*self._seed(request, index), 1])
        num_tokens = len(request.prompt_token_ids) + num_response - 1
        scores = rng.random((num_tokens, settings.moe_layers, settings.moe_num_experts))
        return np.argsort(scores, axis=-1)[..., : settings.moe_top_k].astype(np.int32)  # distinct experts per token

    # control ------------------------------------------------------------------------------
    async def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            for sample in self._live.get(request_id, []):
                sample.aborted = not sample.closed

    async def pause(self, mode: str = "keep") -> None:
        """keep: freeze in-flight requests; wait: let them finish first; abort: end them. New requests wait."""
        async with self._update_lock:
            self.held_by_operator = True
            self._admitting.clear()
            if mode == "abort":
                await self.abort(list(self._live))
            if mode == "wait":
                while self._live:  # the in-flight requests run to their end (vLLM's "wait")
                    await asyncio.sleep(0.01)
            if mode != "abort":  # aborted samples still send their final chunk
                self._running.clear()

    async def resume(self) -> None:
        async with self._update_lock:
            self.held_by_operator = False
            self._admitting.set()
            self._running.set()

    async def commit_weights(
        self,
        version: int,
        staging_path: str,
        manifest_bytes: bytes,
        ipc_record: bytes | None = None,
        load_timeout_s: float | None = None,
    ) -> float:
        """Pause, label ``version`` (no bytes are loaded: the stand-in has no weights), resume unless an operator
        paused the engine; returns the seconds generation was paused."""
        async with self._update_lock:
            started = time.monotonic()
            self._admitting.clear()
            self._running.clear()
            self.last_commit_paused = True
            try:
                if self.settings.commit_s:
                    await asyncio.sleep(self.settings.commit_s)
                self.policy_version = version
            finally:
                if not self.held_by_operator:
                    self._admitting.set()
                    self._running.set()
            return time.monotonic() - started

    def shutdown(self) -> None:
        for samples in self._live.values():
            for sample in samples:
                sample.aborted = not sample.closed
