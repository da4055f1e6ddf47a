"""The rollout servers' section: one vLLM engine behind gRPC per server."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from protos.config.base import Strict

DEMO_MAX_MODEL_LEN = 256  # rollout.max_model_len of the demo's tiny models (model_path '') and the synthetic engine
# The context length each demo model is built with (modeling/ builds them from these): a rollout.max_model_len above it
# is refused when the config loads, as for a checkpoint, not by vLLM in the rollout process once Redis is up.
TINY_CONTEXT_LENGTH = {"qwen3-moe": 256, "qwen3-moe-1b": 256, "beam": 1024}


class SyntheticEngineConfig(Strict):
    """The stand-in engine (``rollout.engine=synthetic``): seeded random tokens at a set rate, weights as no-ops.

    It serves the real gRPC API (validation, backpressure, version reports, weight announcements) without vLLM, so
    one machine can host hundreds of servers for coordinator benchmarks and tests.
    """

    tokens_per_s: float = Field(
        200.0, ge=0.0, description="Tokens per second of each sample (its decode speed); 0 = as fast as possible."
    )
    server_tokens_per_s: float = Field(
        0.0,
        ge=0.0,
        description="Tokens per second of the whole server, shared by its requests (a saturated engine); 0 = no cap.",
    )
    first_token_s: float = Field(0.0, ge=0.0, description="Delay before each request's first token (prefill time).")
    vocab_size: int = Field(64, gt=1, description="Token ids are drawn from [0, vocab_size); prompts are checked too.")
    moe_layers: int = Field(
        0,
        ge=0,
        description="Routed experts returned per token: [prompt + response - 1, moe_layers, moe_top_k]; 0 = none.",
    )
    moe_top_k: int = Field(2, gt=0, description="Experts per token of the synthetic routes.")
    moe_num_experts: int = Field(8, gt=0, description="Expert ids of the synthetic routes are in [0, moe_num_experts).")
    commit_s: float = Field(0.0, ge=0.0, description="Time a weight commit pauses generation (no bytes are loaded).")

    @model_validator(mode="after")
    def _top_k_fits(self) -> SyntheticEngineConfig:
        if self.moe_layers and self.moe_top_k > self.moe_num_experts:
            raise ValueError(
                f"rollout.synthetic.moe_top_k ({self.moe_top_k}) must not exceed rollout.synthetic.moe_num_experts "
                f"({self.moe_num_experts})"
            )
        return self


# vLLM's LoRA slot sizes (vllm.config.lora.MaxLoRARanks, the same in 0.26 and 0.32).
LoraSlotRank = Literal[1, 8, 16, 32, 64, 128, 256, 320, 512]


class RolloutLoraConfig(Strict):
    """vLLM's LoRA slot that serves the trainer's adapters on the frozen base (``trainer.lora.sync='adapters'``).

    Every training request is served with the policy adapter; each new version replaces it in place between a
    pause(keep) and a resume, as full weights are.
    """

    enabled: bool = Field(False, description="Start the engine with LoRA slots (vLLM enable_lora).")
    max_rank: LoraSlotRank = Field(
        64, description="vLLM max_lora_rank, the slot's rank: at least trainer.lora.rank (the dense adapters' rank)."
    )
    max_expert_rank: int = Field(
        0,
        ge=0,
        description="The routed experts' adapter rank the slots are meant for: trainer.lora.rank / top_k with "
        "normalize_moe_lora (the launch guide's max_expert_lora_rank); 0 = max_rank. vLLM 0.26 and 0.32 size "
        "their MoE LoRA slots at max_rank and have no expert size of their own, so this only bounds the expert "
        "rank an adapter may carry.",
    )
    max_loras: int = Field(
        1,
        ge=1,
        le=2,
        description="vLLM max_loras: adapters in one batch. 1 holds the policy adapter (replaced in place at each "
        "version); 2 leaves a slot for another adapter next to it.",
    )

    @model_validator(mode="after")
    def _expert_rank_fits(self) -> RolloutLoraConfig:
        if self.max_expert_rank > self.max_rank:
            raise ValueError(
                f"rollout.lora.max_expert_rank ({self.max_expert_rank}) exceeds rollout.lora.max_rank "
                f"({self.max_rank}): expert adapters live in the same slots; raise max_rank or lower it"
            )
        return self

    def expert_rank_limit(self) -> int:
        return self.max_expert_rank or self.max_rank


class RolloutConfig(Strict):
    """One vLLM AsyncLLM engine behind gRPC (per server)."""

    num_servers: int = Field(2, gt=0, description="Rollout servers the launcher starts.")
    host: str = Field("127.0.0.1", description="Interface the gRPC server binds.")
    base_port: int = Field(0, ge=0, description="First gRPC port; 0 picks free ports.")
    max_model_len: int | None = Field(
        None,
        gt=0,
        description="Prompt + response token limit of the engine. Unset (null): the checkpoint's context length, read "
        "from model_path's config.json when the run's config is loaded (max_position_embeddings or the family's key, "
        "as vLLM derives it: protos/config/checkpoint.py); 256 for the demo's tiny models (model_path '') and the "
        "synthetic engine. A value above the checkpoint's is refused before any process starts.",
    )
    kv_cache_gib: float | None = Field(
        None,
        gt=0,
        description="KV cache size in GiB. CPU: VLLM_CPU_KVCACHE_SPACE (None = 1 GiB). GPU: vLLM's "
        "kv_cache_memory_bytes, which then wins over gpu_memory_utilization (None = sized by the utilization).",
    )
    max_inflight_requests: int = Field(
        256, gt=0, description="Generate calls admitted at once; beyond: RESOURCE_EXHAUSTED."
    )
    max_samples_per_request: int = Field(64, gt=0, description="Upper limit of n in one request.")
    recompute_kv_on_update: bool = Field(
        True, description="Drop KV cache on a weight update so later tokens see only new weights."
    )
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Engine dtype.")
    refit_plan: bool = Field(
        True,
        description="Load weight updates through a copy plan (rollout_service.refit_plan): captured from vLLM's own "
        "loaders on the first update, checked against vLLM's full reload of that version, then every later update "
        "is one batched device copy. A plan that does not reproduce vLLM's reload exactly is dropped (logged) and "
        "updates keep vLLM's reload; false always reloads.",
    )
    weight_updates: Literal["follow", "manual"] = Field(
        "follow",
        description="follow: apply every announced version; manual: only gRPC weight-update calls do (a controller).",
    )
    stream_interval: int = Field(
        1, gt=0, description="Tokens the engine buffers per streamed chunk; larger cuts per-token overhead."
    )
    return_routed_experts: Literal["auto", "on", "off"] = Field(
        "auto", description="Return routed experts for R3: auto = on with a GPU (vLLM on CPU refuses it)."
    )
    tensor_parallel_size: int = Field(
        1, gt=0, description="vLLM tensor parallel size of one server (GPUs per replica / PP)."
    )
    pipeline_parallel_size: int = Field(1, gt=0, description="vLLM pipeline parallel size of one server.")
    enable_expert_parallel: bool = Field(False, description="vLLM expert parallelism for MoE layers (EP = TP x DP).")
    max_num_seqs: int = Field(256, gt=0, description="vLLM: sequences scheduled at once per server.")
    seed: int = Field(0, description="Engine seed.")
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0.0,
        le=1.0,
        description="GPU: fraction of the device's memory this engine may take (weights, "
        "activations, CUDA graphs, KV cache). Lower it when a trainer or another engine shares the GPU.",
    )
    enforce_eager: bool = Field(
        False,
        description="GPU: run eager instead of CUDA graphs + torch.compile (faster start, slower decode). "
        "The CPU engine always runs eager.",
    )
    enable_prefix_caching: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Share KV blocks of equal prompt prefixes across requests (agent sessions, GRPO groups). "
        "auto = on with a GPU. Only with recompute_kv_on_update, which clears the cache at every weight update: kept "
        "blocks would hand a request the old weights' KV under the new version's label.",
    )
    quantization: Literal["none", "mxfp8"] = Field(
        "none",
        description="GPU: serve with vLLM's online quantization. 'mxfp8': weights quantized to E4M3 + E8M0 "
        "per 32 at load and at every weight update (Hopper: MXFP8 weights, bf16 math through Marlin).",
    )
    load_format: Literal["auto", "dummy"] = Field(
        "auto",
        description="vLLM load format; 'dummy' starts on random weights without reading the checkpoint "
        "(benchmarks; the first weight update brings the real ones).",
    )
    kv_cache_dtype: Literal["auto", "fp8_e4m3"] = Field(
        "auto",
        description="KV cache storage dtype: 'auto' = the engine's dtype (bf16 with rollout.dtype bfloat16); "
        "'fp8_e4m3' (GPU) decodes faster at high concurrency and adds about 0.01 to the rollout/trainer logprob "
        "gap (the seed). vLLM refuses an explicit 'bfloat16' for models whose default is not fp8, hence 'auto'. "
        "Env alias KV_CACHE_DTYPE.",
    )

    heartbeat_interval_s: float = Field(
        1.0,
        gt=0,
        description="Seconds between the server's registrations in the run's fleet hash (address, version, load, "
        "capacity); the coordinator discovers servers from them (coordinator.discovery).",
    )
    engine: Literal["vllm", "synthetic"] = Field(
        "vllm",
        description="vllm: a vLLM AsyncLLM on model_path. synthetic: the stand-in engine of rollout.synthetic (no "
        "model, no vLLM; seeded tokens at a set rate, weight updates label the version without loading bytes).",
    )
    synthetic: SyntheticEngineConfig = Field(
        default_factory=SyntheticEngineConfig, description="The stand-in engine's settings (engine=synthetic)."
    )
    lora: RolloutLoraConfig = Field(
        default_factory=RolloutLoraConfig,
        description="LoRA slots serving the trainer's adapters (trainer.lora.sync='adapters'); off by default.",
    )

    @model_validator(mode="after")
    def _synthetic_length(self) -> RolloutConfig:
        if self.max_model_len is None and self.engine == "synthetic":  # the stand-in serves no checkpoint
            self.max_model_len = DEMO_MAX_MODEL_LEN
        return self

    @model_validator(mode="after")
    def _prefix_caching_is_exact(self) -> RolloutConfig:
        if self.enable_prefix_caching == "on" and not self.recompute_kv_on_update:
            raise ValueError(
                "rollout.enable_prefix_caching='on' needs rollout.recompute_kv_on_update=true: cached blocks kept "
                "across a weight update would give new requests the old weights' KV; set one of them differently"
            )
        return self

    def prefix_caching_enabled(self, on_cpu: bool) -> bool:
        if self.enable_prefix_caching == "auto":
            return not on_cpu and self.recompute_kv_on_update
        return self.enable_prefix_caching == "on"
