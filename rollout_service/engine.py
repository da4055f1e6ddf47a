"""RolloutEngine: the plain core of a rollout server, a vLLM AsyncLLM plus policy-version bookkeeping.

It knows nothing of gRPC or Redis: the servicer (``server.py``) and the weight follower
(``weight_sync.py``) are thin adapters around it, and tests can drive it in-process.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from protos.config import RolloutConfig

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "rollout_service.worker_extension.WeightLoaderExtension"


class RequestRejected(ValueError):
    """vLLM refused a request that passed ingress validation (its own checks are the backstop)."""


class EngineUnavailable(RuntimeError):
    """The vLLM engine died or failed the request; the server cannot serve until restarted."""


@dataclass(frozen=True)
class SamplingRequest:
    """A validated generation request (see ``validation.py``)."""

    prompt_token_ids: list[int]
    n: int
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    stop_token_ids: list[int]
    seed: int | None
    logprobs: int
    ignore_eos: bool
    request_id: str = ""
    priority: int = 0
    stream_interval: int = 0  # 0 = the engine's rollout.stream_interval


@dataclass
class SampleChunk:
    """New tokens of one sample; ``finished`` chunks also carry the version spans and routes."""

    request_id: str
    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    finished: bool = False
    finish_reason: str | None = None
    version_spans: list[tuple[int, int, int]] = field(default_factory=list)
    routed_experts: object | None = None  # numpy [tokens, layers, top_k] when the engine returns it


def make_load_tracker():
    """A vLLM stat-logger factory whose loggers keep the scheduler's latest figures (running, waiting)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class LoadTracker(StatLoggerBase):
        latest = None  # the last SchedulerStats; class-level so the engine can read it without a handle

        def __init__(self, vllm_config, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            if scheduler_stats is not None:
                LoadTracker.latest = scheduler_stats

        def log_engine_initialized(self):
            pass

    return LoadTracker


def current_platform_is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _version_label(label: str, initial_version: int) -> int:
    # vLLM labels weights "default" until the first update_weight_version call.
    return initial_version if label == "default" else int(label)


class RolloutEngine:
    """Owns one AsyncLLM; generation, pause/resume and committing new weights go through here."""

    def __init__(self, model_path: str, config: RolloutConfig, server_id: str = ""):
        self.model_path = model_path
        self.config = config
        self.server_id = server_id or f"rollout-{uuid.uuid4().hex[:8]}"
        self.policy_version = 0
        self.routed_experts_available = False
        self.vocab_size = 0
        self._llm = None
        self._load_tracker = None
        self._update_lock = asyncio.Lock()
        self.held_by_operator = False  # paused through the API: a weight update must not resume it

    async def start(self) -> None:
        """Start the engine (tens of seconds on CPU)."""
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(self.config.kv_cache_gib))))
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=self.model_path,
            dtype=self.config.dtype,
            max_model_len=self.config.max_model_len,
            enforce_eager=True,
            skip_tokenizer_init=True,
            seed=self.config.seed,
            worker_extension_cls=WORKER_EXTENSION,
            enable_prefix_caching=False,
            stream_interval=self.config.stream_interval,
            enable_return_routed_experts=self._want_routed_experts(),
            tensor_parallel_size=self.config.tensor_parallel_size,
            pipeline_parallel_size=self.config.pipeline_parallel_size,
            enable_expert_parallel=self.config.enable_expert_parallel,
            max_num_seqs=self.config.max_num_seqs,
            # Logprobs of the distribution each token was drawn from (after temperature, top-p, top-k); vLLM's
            # default is those of the raw logits, which at temperature != 1 is not the rollout policy.
            logprobs_mode="processed_logprobs",
        )
        started = time.monotonic()
        self._load_tracker = make_load_tracker()
        self._llm = AsyncLLM.from_engine_args(args, stat_loggers=[self._load_tracker])
        model_config = self._llm.model_config
        self.vocab_size = model_config.get_vocab_size()
        aux_config = getattr(self._llm.vllm_config, "aux_output_config", None)
        self.routed_experts_available = bool(getattr(aux_config, "enable_return_routed_experts", False))
        if self.config.pipeline_parallel_size > 1 and current_platform_is_cpu():
            await self._llm.collective_rpc("fleetrl_allocate_pipeline_receive_buffer")
        await self._llm.update_weight_version(str(self.policy_version))
        logger.info("engine %s up in %.1fs (vocab %d)", self.server_id, time.monotonic() - started, self.vocab_size)

    def load(self) -> tuple[int, int, float]:
        """(running, waiting, kv-cache usage) as the engine's scheduler last reported them."""
        stats = self._load_tracker.latest if self._load_tracker else None
        if stats is None:
            return 0, 0, 0.0
        return stats.num_running_reqs, stats.num_waiting_reqs + stats.num_skipped_waiting_reqs, stats.kv_cache_usage

    def num_unfinished(self) -> int:
        """Requests the engine front end still tracks (aborted ones leave at once)."""
        return self.llm.output_processor.get_num_unfinished_requests()

    def _want_routed_experts(self) -> bool:
        """R3 needs the routes; vLLM returns them only with its GPU model runner (CPU refuses the option)."""
        if self.config.return_routed_experts != "auto":
            return self.config.return_routed_experts == "on"
        from vllm.platforms import current_platform

        return not current_platform.is_cpu()

    @property
    def llm(self):
        if self._llm is None:
            raise RuntimeError("RolloutEngine.start() has not run")
        return self._llm

    def _sampling_params(self, request: SamplingRequest):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=request.n,
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k if request.top_k > 0 else -1,
            min_p=request.min_p,
            stop_token_ids=request.stop_token_ids,
            seed=request.seed,
            logprobs=request.logprobs,
            ignore_eos=request.ignore_eos,
            output_kind=RequestOutputKind.DELTA,
            detokenize=False,
            stream_interval=request.stream_interval or None,  # vLLM clamps it to >= the engine's
        )

    async def generate(self, request: SamplingRequest) -> AsyncIterator[SampleChunk]:
        """Stream chunks of every sample; aborts the engine request if the consumer stops early."""
        from vllm.inputs import TokensPrompt

        request_id = request.request_id or uuid.uuid4().hex
        stream = self.llm.generate(
            TokensPrompt(prompt_token_ids=request.prompt_token_ids),
            self._sampling_params(request),
            request_id,
            priority=request.priority,
        )
        from vllm.exceptions import VLLMClientError, VLLMServerError

        finished = 0
        try:
            try:
                output = await anext(stream)
                while output is not None:
                    for completion in output.outputs:
                        chunk = self._chunk(request_id, completion)
                        finished += chunk.finished
                        yield chunk
                    output = await anext(stream, None)
            except VLLMClientError as error:
                raise RequestRejected(str(error)) from error
            except VLLMServerError as error:  # EngineDeadError, EngineGenerateError
                raise EngineUnavailable(f"{type(error).__name__}: {error}") from error
        finally:
            if finished < request.n:
                await self.llm.abort(request_id)

    def _chunk(self, request_id: str, completion) -> SampleChunk:
        logprobs = []
        for token_id, entry in zip(completion.token_ids, completion.logprobs or [], strict=False):
            logprobs.append(float(entry[token_id].logprob))
        chunk = SampleChunk(request_id, completion.index, list(completion.token_ids), logprobs)
        if completion.finish_reason is not None:
            chunk.finished = True
            chunk.finish_reason = completion.finish_reason
            chunk.version_spans = [
                (_version_label(s.version, self.policy_version), s.start, s.end)
                for s in completion.weight_versions or []
            ]
            chunk.routed_experts = completion.routed_experts
        return chunk

    async def pause(self, mode: str = "keep") -> None:
        """An operator's pause: it holds until ``resume``, across weight updates (which wait for it, and it for them)."""
        async with self._update_lock:
            self.held_by_operator = True
            await self._pause_engine(mode)

    async def resume(self) -> None:
        async with self._update_lock:  # never in the middle of a weight load
            self.held_by_operator = False
            await self.llm.resume_generation()

    async def _pause_engine(self, mode: str) -> None:
        await self.llm.pause_generation(mode=mode, clear_cache=mode != "keep" or self.config.recompute_kv_on_update)

    async def abort(self, request_ids: list[str]) -> None:
        await self.llm.abort(request_ids)

    async def commit_weights(self, version: int, staging_path: str, manifest_bytes: bytes) -> float:
        """Load staged weights between pause(keep) and resume and label them ``version``.

        In-flight requests survive; tokens sampled after this call carry the new version. An engine an operator
        paused stays paused. Returns the time the engine was paused, in seconds.
        """
        async with self._update_lock:
            started = time.monotonic()
            await self._pause_engine("keep")
            try:
                await self.llm.collective_rpc(
                    "fleetrl_load_staged_weights", args=(staging_path, manifest_bytes)
                )
                await self.llm.update_weight_version(str(version))
                self.policy_version = version
            finally:
                if not self.held_by_operator:  # an operator's pause outlasts the update
                    await self.llm.resume_generation()
            return time.monotonic() - started

    @property
    def errored(self) -> bool:
        """True once the engine core died; the server must stop (a supervisor restarts it)."""
        return self._llm is not None and self._llm.errored

    async def state_checksum(self) -> float:
        results = await self.llm.collective_rpc("fleetrl_state_checksum")
        return float(results[0])

    def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
