"""The arguments a rollout server gives vLLM's ``AsyncEngineArgs``: one place, so the GPU checks and tests read the
same engine a server starts."""

from __future__ import annotations

import logging
import os

from protos.config import RolloutConfig
from rollout_service import cpu_kernels
from rollout_service.lora_slot import engine_lora_kwargs

WORKER_EXTENSION = "rollout_service.worker_extension.WeightLoaderExtension"

log = logging.getLogger(__name__)


def vllm_engine_kwargs(config: RolloutConfig, model_path: str, on_cpu: bool, routed_experts: bool) -> dict:
    """``AsyncEngineArgs`` of this server: the CPU engine eager, the GPU one with CUDA graphs and its memory share."""
    kwargs = {
        "model": model_path,
        "dtype": config.dtype,
        "max_model_len": config.max_model_len,
        "enforce_eager": on_cpu or config.enforce_eager,
        "skip_tokenizer_init": True,
        "seed": config.seed,
        "worker_extension_cls": WORKER_EXTENSION,
        "enable_prefix_caching": config.prefix_caching_enabled(on_cpu),
        # Engine-level chunking; vLLM 0.32 also takes a per-request interval (>= this one), 0.26 does not (then
        # generate() re-chunks).
        "stream_interval": config.stream_interval,
        "enable_return_routed_experts": routed_experts,
        "tensor_parallel_size": config.tensor_parallel_size,
        "pipeline_parallel_size": config.pipeline_parallel_size,
        "enable_expert_parallel": config.enable_expert_parallel,
        "max_num_seqs": config.max_num_seqs,
        # Logprobs of the distribution each token was drawn from (after temperature, top-p, top-k); vLLM's
        # default is those of the raw logits, which at temperature != 1 is not the rollout policy.
        "logprobs_mode": "processed_logprobs",
    }
    kwargs.update(engine_lora_kwargs(config.lora))
    if config.load_format != "auto":
        kwargs["load_format"] = config.load_format
    if config.kv_cache_dtype != "auto":
        kwargs["kv_cache_dtype"] = config.kv_cache_dtype
    kwargs.update(cpu_kernels.engine_kwargs(model_path, config.dtype) if on_cpu else {})
    if not on_cpu:
        kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
        if config.kv_cache_gib is not None:
            kwargs["kv_cache_memory_bytes"] = int(config.kv_cache_gib * 2**30)
            devices = config.tensor_parallel_size * config.pipeline_parallel_size
            kwargs["gpu_memory_utilization"] = startup_share(config.gpu_memory_utilization, gpu_free_share(devices))
    if config.quantization != "none":
        if on_cpu:
            raise ValueError(
                f"rollout.quantization={config.quantization!r} needs a GPU engine (vLLM on CPU has no "
                "MXFP8 kernels); set rollout.quantization=none"
            )
        kwargs["quantization"] = config.quantization
    return kwargs


def startup_share(configured: float, free_share: float | None, margin: float = 0.02) -> float:
    """The ``gpu_memory_utilization`` to start vLLM with when its KV cache is sized in bytes (``rollout.kv_cache_gib``).

    vLLM then sizes nothing by the share; it only refuses to start unless that share of the device is free. Beside a
    trainer on the same GPU that is wrong after the first start: the trainer has grown into what the engine did not
    take, so a server restarted after a crash was refused every time (2026-12-07, H100: "Free memory on device
    (26.72/79.18 GiB) on startup is less than desired GPU memory utilization (0.35, 27.71 GiB)" for an engine that
    needs ~13 GiB) and the launcher gave up on it. So the share asked is at most what is free now, less a margin;
    whether the engine fits is then vLLM's own allocation to say."""
    if free_share is None or free_share - margin >= configured:
        return configured
    lowered = round(max(free_share - margin, 0.01), 4)
    log.warning(
        "rollout: %.0f%% of the GPU is free, below gpu_memory_utilization %.2f; with kv_cache_gib set vLLM only checks "
        "the share at start, so the engine starts with %.4f",
        100 * free_share,
        configured,
        lowered,
    )
    return lowered


def gpu_free_share(devices: int) -> float | None:
    """The smallest free share of memory among the first ``devices`` visible GPUs, read through NVML (no CUDA context
    in this process, which vLLM's engine processes fork from); None where NVML cannot say."""
    try:
        import pynvml
    except ImportError:
        return None
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver: a CPU machine
        return None
    try:
        shares = []
        for index in range(devices):
            name = visible[index] if index < len(visible) else str(index)
            handle = (
                pynvml.nvmlDeviceGetHandleByIndex(int(name))
                if name.isdigit()
                else pynvml.nvmlDeviceGetHandleByUUID(name)
            )
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            shares.append(memory.free / memory.total)
        return min(shares)
    except Exception:  # noqa: BLE001 - an index or id NVML does not know: leave the configured share
        return None
    finally:
        pynvml.nvmlShutdown()
