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
from protos.records import decode_manifest
from rollout_service import engine_args, metrics, vllm_adapter
from rollout_service.load_watchdog import LOAD_STEP, PAUSE_STEP, WeightLoadTimeout, within_load_timeout
from rollout_service.lora_slot import LoraSlot, adapter_to_load, check_engine_supports, lora_root
from rollout_service.vllm_adapter import ChunkBuffer, VersionSpanTracker, current_platform_is_cpu, make_load_tracker
from weight_bus.ipc import IpcUnavailable

logger = logging.getLogger(__name__)


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
    engine_version_spans: list[tuple[int, int, int]] | None = None  # vLLM's own, when cross-checking (tests)
    top_token_ids: list[int] = field(default_factory=list)  # [tokens, request.logprobs] row-major, by rank
    top_logprobs: list[float] = field(default_factory=list)


def _version_label(label: str, initial_version: int) -> int:
    # vLLM labels weights "default" until the first update_weight_version call.
    return initial_version if label == "default" else int(label)


class RolloutEngine:
    """Owns one AsyncLLM; generation, pause/resume and committing new weights go through here."""

    loads_weight_bytes = True  # a commit loads the staged (or IPC) bytes into the workers

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
        self.last_load_s = 0.0  # seconds the last commit spent loading weights into the engine
        self.failure = ""  # why the engine cannot serve any more although its core lives (a load that timed out)
        self.features: vllm_adapter.VllmFeatures | None = None
        self._spans = VersionSpanTracker()  # used where vLLM keeps no weight versions (0.26)
        self._committed = asyncio.Event()  # cleared while a commit runs: new requests wait (see generate)
        self._committed.set()
        self._generating = 0  # generate() calls past that gate and not finished
        self.last_commit_paused = False  # whether the last commit had to pause the engine (see commit_weights)
        self._prefix_caching = False  # set at start: cached KV blocks must be dropped at every commit
        # With fleetrl's spans forced on a vLLM that keeps its own: label versions in the engine too and hand its
        # spans along (SampleChunk.engine_version_spans), so tests compare the two on the same samples.
        self.cross_check_spans = False
        # rollout.lora: the policy's adapter in vLLM's LoRA slot, attached to every request (None: weights only)
        self.lora_slot = LoraSlot(config.lora, model_path, lora_root(self.server_id)) if config.lora.enabled else None

    async def start(self) -> None:
        """Start the engine (tens of seconds on CPU, about a minute on a GPU with CUDA graphs)."""
        self.features = vllm_adapter.detect()
        on_cpu = current_platform_is_cpu()
        if on_cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(self.config.kv_cache_gib or 1))))
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        check_engine_supports(self.config.lora, self.model_path, on_cpu)
        args = AsyncEngineArgs(**self.engine_kwargs(on_cpu))
        self._prefix_caching = self.config.prefix_caching_enabled(on_cpu)
        started = time.monotonic()
        self._load_tracker = make_load_tracker(metrics.count_generated)
        self._llm = AsyncLLM.from_engine_args(args, stat_loggers=[self._load_tracker])
        model_config = self._llm.model_config
        self.vocab_size = model_config.get_vocab_size()
        self.routed_experts_available = bool(
            getattr(model_config, "enable_return_routed_experts", False)  # 0.26
            or getattr(getattr(self._llm.vllm_config, "aux_output_config", None), "enable_return_routed_experts", False)
        )
        if self.config.pipeline_parallel_size > 1 and on_cpu:
            await self._llm.collective_rpc("fleetrl_allocate_pipeline_receive_buffer")
        if self.features.engine_weight_versions:
            await self._llm.update_weight_version(str(self.policy_version))
        if self.lora_slot is not None:
            await self.lora_slot.start(self._llm)
        logger.info(
            "engine %s up in %.1fs (vLLM %s%s, vocab %d, routed experts %s)",
            self.server_id,
            time.monotonic() - started,
            self.features.version,
            ", fleetrl version spans" if self.features.fallback else "",
            self.vocab_size,
            "on" if self.routed_experts_available else "off",
        )

    def engine_kwargs(self, on_cpu: bool) -> dict:
        """``AsyncEngineArgs`` of this server (rollout_service.engine_args)."""
        return engine_args.vllm_engine_kwargs(self.config, self.model_path, on_cpu, self._want_routed_experts())

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

        extra = {}
        if self.features.request_stream_interval:
            extra["stream_interval"] = request.stream_interval or None  # vLLM clamps it to >= the engine's
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
            **extra,
        )

    async def generate(self, request: SamplingRequest) -> AsyncIterator[SampleChunk]:
        """Stream chunks of every sample; aborts the engine request if the consumer stops early."""
        from vllm.inputs import TokensPrompt

        request_id = request.request_id or uuid.uuid4().hex
        features = self.features
        # A request added while a commit runs could not generate before it anyway; waiting keeps fleetrl's spans
        # simple: every request it tracks existed before the commit's count, or starts after it.
        await self._committed.wait()
        stream = self.llm.generate(
            TokensPrompt(prompt_token_ids=request.prompt_token_ids),
            self._sampling_params(request),
            request_id,
            lora_request=self.lora_slot.request() if self.lora_slot is not None else None,
            priority=request.priority,
        )
        self._generating += 1  # no await since the gate: a commit that starts from here on sees this request
        own_spans = not features.engine_weight_versions
        if own_spans:
            self._spans.open(request_id, request.n, self.policy_version)
        interval = max(request.stream_interval, self.config.stream_interval)
        buffer = None if features.request_stream_interval else ChunkBuffer(interval)
        received = [0] * request.n  # response tokens per sample so far
        finished = 0
        try:
            try:
                output = await anext(stream)
                while output is not None:
                    for completion in output.outputs:
                        chunk = self._chunk(request_id, completion, received, own_spans, request.logprobs)
                        if buffer is not None and not buffer.push(chunk):
                            continue
                        finished += chunk.finished
                        yield chunk
                    output = await anext(stream, None)
            except features.client_errors as error:
                raise RequestRejected(str(error)) from error
            except features.server_errors as error:
                raise EngineUnavailable(f"{type(error).__name__}: {error}") from error
        finally:
            if own_spans:
                self._spans.close(request_id)
            try:
                if finished < request.n:
                    await self.llm.abort(request_id)
            finally:
                self._generating -= 1

    def _chunk(self, request_id: str, completion, received: list[int], own_spans: bool, top: int) -> SampleChunk:
        logprobs, top_ids, top_logprobs = [], [], []
        for token_id, entry in zip(completion.token_ids, completion.logprobs or [], strict=False):
            logprobs.append(float(entry[token_id].logprob))
            if top:
                vllm_adapter.top_by_rank(entry, top, top_ids, top_logprobs)
        chunk = SampleChunk(request_id, completion.index, list(completion.token_ids), logprobs)
        chunk.top_token_ids, chunk.top_logprobs = top_ids, top_logprobs
        received[completion.index] += len(chunk.token_ids)
        if completion.finish_reason is not None:
            chunk.finished = True
            chunk.finish_reason = completion.finish_reason
            engine_spans = [
                (_version_label(s.version, self.policy_version), s.start, s.end)
                for s in getattr(completion, "weight_versions", None) or []
            ]
            if own_spans:
                chunk.version_spans = self._spans.spans(request_id, completion.index, received[completion.index])
                chunk.engine_version_spans = engine_spans if self.cross_check_spans else None
            else:
                chunk.version_spans = engine_spans
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

    async def ipc_unopenable_reason(self, record_bytes: bytes) -> str:
        """'' when every worker can open a version's CUDA IPC buckets (transport 'ipc'), else the first reason."""
        reasons = await self.llm.collective_rpc("fleetrl_ipc_unopenable_reason", args=(record_bytes,))
        return next((reason for reason in reasons if reason), "")

    async def commit_weights(
        self,
        version: int,
        staging_path: str,
        manifest_bytes: bytes,
        ipc_record: bytes | None = None,
        load_timeout_s: float | None = None,
    ) -> float:
        """Load staged weights (or, with ``ipc_record``, the trainer's device buckets) between pause(keep) and
        resume and label them ``version``.

        In-flight requests survive; tokens sampled after this call carry the new version. An engine an operator
        paused stays paused. Returns the seconds generation was held (paused, and new requests kept waiting).
        Raises IpcUnavailable, with the engine unchanged, when a worker cannot open the IPC buckets, and
        WeightLoadTimeout past ``load_timeout_s`` (then the engine stays paused and reports ``errored``).

        With nothing generating (on-policy, between steps) and no prefix cache to drop, no request can see the weights
        change: no pause then (vLLM's pause and resume cost two engine-core round trips and a 20 ms sleep).
        """
        # A LoRA adapter's PEFT directory is written before the pause (None for weights).
        adapter_dir = adapter_to_load(self.lora_slot, version, staging_path, decode_manifest(manifest_bytes))
        async with self._update_lock:
            started = time.monotonic()
            self._committed.clear()  # from here on new requests wait: the count below stays true
            paused = self.last_commit_paused = self._generating > 0 or self._prefix_caching
            try:
                if paused:
                    await self._bounded(self._pause_engine("keep"), version, load_timeout_s, PAUSE_STEP)
                counts = await self._count_tokens_before_commit()
                load_started = time.monotonic()
                if adapter_dir is not None:
                    await self.lora_slot.swap(self.llm, adapter_dir)
                else:
                    await self._load_weights(version, staging_path, manifest_bytes, ipc_record, load_timeout_s)
                self.last_load_s = time.monotonic() - load_started  # the load alone, inside the pause (reports)
                if self.features.engine_weight_versions or self.cross_check_spans:
                    await self.llm.update_weight_version(str(version))
                if not self.features.engine_weight_versions:
                    self._spans.mark(version, counts)
                self.policy_version = version
            finally:
                self._committed.set()
                if adapter_dir is not None:
                    self.lora_slot.discard(adapter_dir)  # kept only when it went into force
                # An operator's pause outlasts the update; a timed-out load never serves its half-new weights.
                if paused and not self.held_by_operator and not self.failure:
                    await self.llm.resume_generation()
            return time.monotonic() - started

    async def _load_weights(self, version, staging_path, manifest_bytes, ipc_record, timeout_s) -> None:
        """Load a version into every worker, from staging or the trainer's IPC buckets, within ``timeout_s``."""
        stacks_after_s = timeout_s / 2 if timeout_s else 0.0  # the worker's stacks reach the log before we give up
        if ipc_record is None:
            call = "fleetrl_load_staged_weights", (staging_path, manifest_bytes, self.config.refit_plan, stacks_after_s)
        else:
            call = "fleetrl_load_ipc_weights", (ipc_record, manifest_bytes, self.config.refit_plan, stacks_after_s)
        loaded = await self._bounded(self.llm.collective_rpc(call[0], args=call[1]), version, timeout_s, LOAD_STEP)
        if ipc_record is not None and any(count < 0 for count in loaded):
            raise IpcUnavailable(f"v{version}: a worker could not open the IPC buckets")

    async def _bounded(self, step, version: int, timeout_s: float | None, what: tuple[str, str]):
        """A step of a weight update within ``weight_bus.load_timeout_s``; past it the engine is failed (never resumed,
        reported errored: the server's watch stops it)."""
        try:
            return await within_load_timeout(step, version, timeout_s, self.server_id, what)
        except WeightLoadTimeout as error:
            self.failure = str(error)
            raise

    async def _count_tokens_before_commit(self) -> dict[tuple[str, int], int]:
        """Tokens every live sample holds before new weights load (fleetrl's spans; {} where vLLM keeps them)."""
        if self.features.engine_weight_versions:
            return {}
        await vllm_adapter.wait_outputs_processed(self.llm)
        return vllm_adapter.generated_token_counts(self.llm, self._spans.live_requests())

    @property
    def errored(self) -> bool:
        """True once the engine core died or a load timed out; the server must stop (a supervisor restarts it)."""
        return bool(self.failure) or (self._llm is not None and self._llm.errored)

    async def state_checksum(self) -> float:
        results = await self.llm.collective_rpc("fleetrl_state_checksum")
        return float(results[0])

    def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
        if self.lora_slot is not None:
            self.lora_slot.close()
