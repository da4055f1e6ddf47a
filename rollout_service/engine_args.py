"""The arguments a rollout server gives vLLM's ``AsyncEngineArgs``: one place, so the GPU checks and tests read the
same engine a server starts."""

from __future__ import annotations

from protos.config import RolloutConfig
from rollout_service import cpu_kernels
from rollout_service.lora_slot import engine_lora_kwargs

WORKER_EXTENSION = "rollout_service.worker_extension.WeightLoaderExtension"


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
    if config.quantization != "none":
        if on_cpu:
            raise ValueError(
                f"rollout.quantization={config.quantization!r} needs a GPU engine (vLLM on CPU has no "
                "MXFP8 kernels); set rollout.quantization=none"
            )
        kwargs["quantization"] = config.quantization
    return kwargs
