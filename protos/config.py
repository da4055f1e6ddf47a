"""The typed config tree of a run: one schema that every role process reads from a JSON file.

It lives in protos/ because the resolved config is the contract handed from the launcher to each role
process; each role's ``config.py`` re-exports its section. Imports neither torch nor vLLM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class SamplingConfig(_Strict):
    """Sampling of training rollouts."""

    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature; 1.0 keeps logprobs exact.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(-1, description="Top-k; -1 disables.")
    max_tokens: int = Field(8, gt=0, description="Maximum response tokens per sample.")


class OverlongConfig(_Strict):
    """DAPO soft overlong punishment, added to the reward of long responses."""

    enabled: bool = Field(False, description="Apply the penalty to training rewards (never to eval).")
    buffer_len: int = Field(
        0, ge=0, description="Ramp length in tokens: the penalty grows from 0 at max_tokens - buffer_len to -factor."
    )
    penalty_factor: float = Field(1.0, ge=0, description="Penalty at and beyond sampling.max_tokens.")


class EvalConfig(_Strict):
    """Evaluation rounds, each pinned to one policy version (every sample comes from exactly that version)."""

    datasets: list[str] = Field(
        default_factory=list, description="Eval files (.jsonl/.parquet); metrics are keyed by file stem."
    )
    interval_steps: int = Field(0, ge=0, description="Evaluate every this many trainer steps; 0 = never.")
    at_start: bool = Field(False, description="Also evaluate the initial policy before training starts.")
    samples_per_problem: int = Field(4, gt=0, description="k samples per problem; reports mean accuracy and pass@k.")
    limit: int | None = Field(None, gt=0, description="Use only the first N problems of each file; None = all.")
    sampling: SamplingConfig | None = Field(None, description="Eval sampling; None = the training sampling.")
    reward_fn: str = Field("math", description="Reward of eval samples; a sample is correct when reward >= 1.")
    timeout_s: float = Field(600.0, gt=0, description="Longest wait for one eval round (version, servers, samples).")


class CoordinatorConfig(_Strict):
    """Prompts, grouping, admission and the push onto the trajectory queue."""

    task: str = Field("echo", description="Built-in task name ('echo') or a dataset path (.jsonl/.parquet).")
    reward_fn: str = Field(
        "math", description="Dataset tasks: built-in reward ('math') or 'module.path:function' (sync or async)."
    )
    prompt_template: str = Field(
        "", description="Template with '{problem}' for plain {problem, answer} rows; '' = the loader's default."
    )
    template_chat_prompts: bool = Field(False, description="Also apply prompt_template to verl/DAPO chat rows.")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra variables for the tokenizer's chat template, e.g. reasoning_effort."
    )
    dataset_limit: int | None = Field(None, gt=0, description="Use only the first N rows of the dataset; None = all.")
    group_size: int = Field(8, gt=0, description="Samples per prompt (GRPO group size n).")
    groups_per_step: int = Field(8, gt=0, description="Groups the trainer consumes per optimizer step (B).")
    max_staleness: int = Field(1, ge=0, description="Bound k on v_trainer - min token version; 0 = on-policy.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    overlong: OverlongConfig = Field(default_factory=OverlongConfig)
    dynamic_sampling: bool = Field(
        False, description="Skip groups whose rewards are all equal and admit a new prompt in their place."
    )
    dynamic_sampling_max_tries: int = Field(
        8, gt=0, description="Prompts tried per group slot before a uniform group is pushed anyway (counted)."
    )
    reward_timeout_s: float = Field(30.0, gt=0, description="Limit of one reward call; a timeout scores 0.")
    reward_threads: int = Field(2, gt=0, description="Threads that run sync reward functions off the event loop.")
    eval: EvalConfig = Field(default_factory=EvalConfig)
    request_timeout_s: float = Field(120.0, gt=0, description="Deadline of one Generate call.")
    max_attempts: int = Field(3, gt=0, description="Dispatch attempts of one group before the run fails.")
    admin_host: str = Field("127.0.0.1", description="Interface the admin gRPC API and /metrics bind.")
    admin_port: int = Field(50050, ge=0, description="Admin gRPC API port (fleetrl status, ...); 0 picks a free one.")
    metrics_port: int = Field(0, ge=0, description="Prometheus /metrics port; 0 = off.")
    seed: int = Field(0, description="Seed of the prompt order.")
    dashboard: bool = Field(True, description="Serve the live web dashboard from the coordinator.")
    dashboard_host: str = Field("127.0.0.1", description="Interface the dashboard binds.")
    dashboard_port: int = Field(0, ge=0, description="Dashboard port; 0 picks a free one (logged).")

    @model_validator(mode="after")
    def _overlong_fits(self) -> CoordinatorConfig:
        if self.overlong.enabled and self.overlong.buffer_len > self.sampling.max_tokens:
            raise ValueError(
                f"coordinator.overlong.buffer_len ({self.overlong.buffer_len}) must not exceed "
                f"coordinator.sampling.max_tokens ({self.sampling.max_tokens}); lower the buffer"
            )
        if self.dynamic_sampling and self.group_size < 2:
            raise ValueError(
                "coordinator.dynamic_sampling needs coordinator.group_size >= 2 (a group of one "
                "always has equal rewards)"
            )
        eval_sampling = self.eval.sampling or self.sampling
        if self.eval.datasets and self.eval.samples_per_problem > 1 and eval_sampling.temperature == 0:
            raise ValueError(
                "coordinator.eval.samples_per_problem > 1 needs a sampling temperature > 0 "
                "(greedy samples would be identical); set coordinator.eval.sampling.temperature"
            )
        return self


class RolloutConfig(_Strict):
    """One vLLM AsyncLLM engine behind gRPC (per server)."""

    num_servers: int = Field(2, gt=0, description="Rollout servers the launcher starts.")
    host: str = Field("127.0.0.1", description="Interface the gRPC server binds.")
    base_port: int = Field(0, ge=0, description="First gRPC port; 0 picks free ports.")
    max_model_len: int = Field(256, gt=0, description="Prompt + response token limit of the engine.")
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


class MegatronConfig(_Strict):
    """The Megatron backend: parallel layout and model settings (trainer.backend = 'megatron').

    The product tensor x pipeline x context parallel sizes must divide the trainer's world size
    (trainer.num_nodes x trainer.num_processes); what is left is data parallel. On CPU the ranks run on gloo.
    """

    tensor_model_parallel_size: int = Field(1, ge=1, description="TP: ranks that split each layer's matrices.")
    pipeline_model_parallel_size: int = Field(
        1, ge=1, description="PP: ranks that split the layer stack (micro-batches padded to one shape)."
    )
    expert_model_parallel_size: int = Field(1, ge=1, description="EP: ranks that split the MoE experts.")
    expert_tensor_parallel_size: int | None = Field(
        None,
        ge=1,
        description="ETP: ranks that split each expert's matrices; None = the TP size (megatron's default). "
        "EP x ETP must divide the ranks of one pipeline stage.",
    )
    context_parallel_size: int = Field(
        1, ge=1, description="CP: ranks that split the sequence (only 1 is implemented in MegatronBackend)."
    )
    params_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Model parameter dtype; bfloat16 keeps fp32 main weights in the optimizer."
    )
    use_distributed_optimizer: bool = Field(True, description="Shard optimizer state over data-parallel ranks.")
    moe_token_dispatcher: Literal["allgather", "alltoall"] = Field(
        "allgather", description="MoE token dispatcher; 'alltoall' needs CUDA (it creates a CUDA stream)."
    )
    moe_grouped_gemm: bool = Field(False, description="Grouped GEMM for the experts (CUDA only).")
    moe_aux_loss_coeff: float = Field(
        0.0, ge=0.0, description="Load-balancing aux loss weight; 0 keeps the loss equal to the policy loss."
    )
    routing_replay: bool = Field(
        True, description="Build routers with routing replay (R3) so rollout routes can be replayed."
    )
    moe_router_bias_update_rate: float = Field(
        0.0,
        ge=0.0,
        description="Aux-loss-free balancing step on routers with an expert bias (Beam's e_score_correction_bias) "
        "per optimizer step; 0 keeps the checkpoint's bias, so rollout and trainer route alike.",
    )


class LoraConfig(_Strict):
    """Low-rank adapters (LoRA): the base weights stay frozen and only ``A`` [r, in] / ``B`` [out, r] train.

    Module names are megatron-core's, which both backends understand: ``linear_qkv`` (HF q_proj, k_proj, v_proj),
    ``linear_proj`` (o_proj), ``linear_fc1`` (gate_proj + up_proj, dense MLP and every routed expert),
    ``linear_fc2`` (down_proj). Routers, norms, embeddings and the LM head are never adapted. The trainer
    publishes the merged weights ``W + alpha / r * B @ A`` of the adapted modules only: the rest of a rollout
    server's weights never change from the base checkpoint.
    """

    rank: int = Field(0, ge=0, description="Adapter rank r; 0 = full fine-tuning (no LoRA).")
    alpha: float = Field(32.0, gt=0, description="Scale numerator: the update is alpha / rank * B @ A.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter's input (training only).")
    target_modules: list[Literal["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]] = Field(
        default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
        min_length=1,
        description="Adapted modules (megatron-core names; see the class docstring for the HF ones).",
    )

    @property
    def enabled(self) -> bool:
        return self.rank > 0


class TrainerConfig(_Strict):
    """The trainer role: queue consumption, loss, optimizer, weight publishing."""

    backend: Literal["torch", "megatron"] = Field("torch", description="Training backend.")
    num_steps: int = Field(40, gt=0, description="Optimizer steps before the trainer stops.")
    lr: float = Field(5e-3, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Max global grad norm.")
    clip_low: float = Field(0.2, ge=0, description="PPO clip epsilon below 1.")
    clip_high: float = Field(0.28, ge=0, description="PPO clip epsilon above 1 (clip-higher).")
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    geo_mask: tuple[float, float] | None = Field((0.99, 1.01), description="Geometric sequence mask bounds.")
    token_tis_cap: float | None = Field(None, description="Token TIS cap; None disables.")
    icepop: tuple[float, float] | None = Field(None, description="ICEPOP token mask bounds; None disables.")
    batch_timeout_s: float = Field(600.0, gt=0, description="Longest wait for one step's groups.")
    seed: int = Field(0, description="Torch seed.")
    lr_warmup_steps: int = Field(0, ge=0, description="Linear LR warm-up steps from 0 to lr; constant after.")
    mini_batches: int = Field(
        1,
        gt=0,
        description="Optimizer steps per training step (PPO mini-batches of whole groups); pi_old is the "
        "policy at the step's start and one version is published per step.",
    )
    micro_batch_tokens: int = Field(
        0, ge=0, description="Padded-token budget of one micro-batch (gradient accumulation); 0 = whole step at once."
    )
    trim_acknowledged: bool = Field(
        True, description="Delete acknowledged entries from the trajectory stream (False keeps it as an audit log)."
    )
    ckpt_interval: int = Field(
        1, gt=0, description="Steps between checkpoints; queue entries are acknowledged only at a checkpoint."
    )
    keep_last_checkpoints: int = Field(2, gt=0, description="Checkpoints kept on disk (older ones are deleted).")
    ckpt_dir: str = Field(
        "", description="Checkpoint directory; '' = <out_dir>/checkpoints (runs/<run_id>/... without out_dir)."
    )
    resume: str = Field(
        "latest", description="'latest' (resume from the newest checkpoint if any), 'none', or a checkpoint path."
    )
    metrics_port: int = Field(0, ge=0, description="Prometheus /metrics port of the trainer; 0 = off.")
    measure_replay_mismatch: bool = Field(
        False,
        description="Per step with rollout routes, report the on-policy |trainer - rollout| logprob with the "
        "routes replayed (R3) and with natural routing (on_policy_abs_logprob_diff_r3 / _natural); two extra forwards.",
    )
    megatron: MegatronConfig = Field(
        default_factory=MegatronConfig, description="Megatron backend settings (used when backend = 'megatron')."
    )
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters; rank 0 = full fine-tuning.")
    num_processes: int = Field(
        1,
        ge=1,
        description="Trainer ranks per node (torchrun --nproc-per-node); > 1 needs backend 'megatron'.",
    )
    num_nodes: int = Field(
        1,
        ge=1,
        description="Trainer nodes. The world size is num_nodes x num_processes; megatron's TP x PP x CP "
        "must divide it and what is left is data parallel. `fleetrl run` launches one node; deploy/ launches more.",
    )

    @model_validator(mode="after")
    def _ranks_fit_backend(self) -> TrainerConfig:
        world_size = self.num_nodes * self.num_processes
        if world_size > 1 and self.backend != "megatron":
            raise ValueError(
                f"trainer world size {world_size} (num_nodes x num_processes) needs trainer.backend='megatron'"
            )
        model_parallel = (
            self.megatron.tensor_model_parallel_size
            * self.megatron.pipeline_model_parallel_size
            * self.megatron.context_parallel_size
        )
        megatron = self.megatron
        if self.backend == "megatron" and world_size % model_parallel:
            raise ValueError(
                f"trainer world size {world_size} (num_nodes x num_processes) is not a multiple of megatron "
                f"TP x PP x CP = {model_parallel}"
            )
        expert_parallel = megatron.expert_model_parallel_size * (
            megatron.expert_tensor_parallel_size or megatron.tensor_model_parallel_size
        )
        stage_ranks = world_size // megatron.pipeline_model_parallel_size
        if self.backend == "megatron" and stage_ranks % expert_parallel:
            raise ValueError(
                f"trainer.megatron: EP x ETP = {expert_parallel} does not divide the {stage_ranks} ranks of a pipeline "
                f"stage (world size {world_size} / PP {megatron.pipeline_model_parallel_size})"
            )
        return self

    @model_validator(mode="after")
    def _lora_keeps_the_base_frozen(self) -> TrainerConfig:
        if self.lora.enabled and self.megatron.moe_router_bias_update_rate > 0:
            raise ValueError(
                "trainer.megatron.moe_router_bias_update_rate > 0 moves router biases, which LoRA (trainer.lora.rank "
                "> 0) keeps frozen with the rest of the base model; set it to 0"
            )
        return self


class WeightBusConfig(_Strict):
    """How new weights travel from trainer to rollout servers."""

    transport: Literal["tcp", "nccl", "ipc"] = Field(
        "tcp",
        description="'tcp': receivers pull over sockets (CPU machines, tests); 'nccl': the trainer broadcasts "
        "to one process per GPU (weight_bus.nccl) and still serves late receivers over tcp; 'ipc': a trainer that "
        "shares its GPU with the rollout engine (colocated) hands it the packed buckets by CUDA IPC handles "
        "(weight_bus.ipc), tcp for receivers that cannot open them; without CUDA at the trainer it is tcp.",
    )
    host: str = Field("127.0.0.1", description="Interface the publisher binds.")
    port: int = Field(0, ge=0, description="Publisher port; 0 picks a free one.")
    bucket_mib: float = Field(
        512.0, gt=0, description="Bucket size in MiB; a larger tensor gets a bucket of its own (nccl splits it)."
    )
    keep_versions: int = Field(4, gt=0, description="Versions the publisher keeps to serve late receivers.")
    fetch_timeout_s: float = Field(60.0, gt=0, description="Deadline of one receive without progress.")
    codec: Literal["bf16", "mxfp8"] = Field(
        "bf16",
        description="Wire codec. 'bf16': pass-through, every tensor travels in its own dtype. 'mxfp8': eligible "
        "2-D weights travel as float8_e4m3 + uint8 E8M0 scales per 1x32 block (about 52% of bf16 bytes); norms, "
        "biases, routers, e_score_correction_bias, embeddings and the LM head stay in their own dtype.",
    )
    mxfp8_rule: Literal["rceil", "floor"] = Field(
        "rceil", description="MXFP8 scale rule: 'rceil' never clips (NVIDIA recipe); 'floor' is the OCP spec rule."
    )
    quantize_embeddings: bool = Field(False, description="With codec 'mxfp8', quantize the token embeddings too.")
    quantize_lm_head: bool = Field(False, description="With codec 'mxfp8', quantize the LM head too.")
    receive_mode: Literal["dequantize", "mxfp8"] = Field(
        "dequantize",
        description="Rollout side, for MXFP8 manifests. 'dequantize': decode (q, scale) pairs to the engine's dtype "
        "at load. 'mxfp8': load the pairs as they are into an engine serving an MXFP8 checkpoint (GPU only: "
        "vLLM on CPU has no MXFP8 kernel).",
    )
    snapshot_dir: str = Field(
        "",
        description="Directory (shared with the rollout servers) where the publisher writes each version's manifest "
        "and buckets, so a receiver can load it when the publisher is unreachable; '' = off.",
    )
    keep_snapshots: int = Field(2, ge=1, le=8, description="Snapshots kept in snapshot_dir (oldest removed first).")
    send_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Longest the publisher waits on a receiver making no progress (tcp: one socket send; nccl: one "
        "bucket broadcast) before it gives up on that receiver.",
    )
    group_timeout_s: float = Field(
        120.0, gt=0, description="nccl: deadline for forming or re-forming the broadcast group."
    )
    heartbeat_timeout_s: float = Field(
        10.0,
        gt=0,
        description="nccl: a subscriber whose heartbeat in Redis is older than this is left out of a rebuilt group.",
    )

    @model_validator(mode="after")
    def _receive_mode_fits_codec(self) -> WeightBusConfig:
        if self.receive_mode == "mxfp8" and self.codec != "mxfp8":
            raise ValueError(
                "weight_bus.receive_mode='mxfp8' needs weight_bus.codec='mxfp8' (an MXFP8 engine cannot load "
                "bf16 weights); set codec='mxfp8' or receive_mode='dequantize'"
            )
        return self


class RunConfig(_Strict):
    """The whole run. Shared keys live here and are read by every role."""

    run_id: str = Field("demo", description="Namespace of the run's Redis keys.")
    model_path: str = Field("", description="HF checkpoint directory; '' = build (and cache) the demo's tiny model.")
    tiny_model: Literal["qwen3-moe", "beam", "qwen3-moe-1b"] = Field(
        "qwen3-moe",
        description="Which model the demo builds when model_path is '': the tiny Qwen3-MoE, the tiny "
        "Beam, or the GPU demo's 0.94 B Qwen3-MoE (bf16; warmed up on the GPU). All have the echo vocabulary.",
    )
    redis_url: str = Field("", description="Redis URL; '' = start an embedded valkey server.")
    out_dir: str = Field("", description="Run directory (logs, summary.json, checkpoints).")
    coordinator: CoordinatorConfig = Field(default_factory=CoordinatorConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    weight_bus: WeightBusConfig = Field(default_factory=WeightBusConfig)

    @field_validator("run_id")
    @classmethod
    def _run_id_is_a_key_part(cls, value: str) -> str:
        if not value or any(c in value for c in " :\n"):
            raise ValueError("run_id must be non-empty without spaces or ':' (it is part of Redis keys)")
        return value

    @model_validator(mode="after")
    def _lengths_fit(self) -> RunConfig:
        if self.coordinator.sampling.max_tokens >= self.rollout.max_model_len:
            raise ValueError(
                "coordinator.sampling.max_tokens must be below rollout.max_model_len "
                f"({self.coordinator.sampling.max_tokens} >= {self.rollout.max_model_len})"
            )
        return self


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides to a nested dict, each value parsed by the type of the field it sets.

    Text fields (``str``, and ``Literal`` choices of text such as ``rollout.return_routed_experts=on``) take the
    text as written: YAML would read ``on`` as ``True`` and ``42`` as a number, which the field then refuses.
    Every other field takes the value as a YAML scalar or list (``trainer.icepop=[0.5, 2.0]``, ``x=null``).
    """
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} is not KEY=VALUE (e.g. trainer.lr=1e-6)")
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r}: {part!r} is not a section")
        try:
            node[parts[-1]] = parse_override_value(field_annotation(parts), raw)
        except yaml.YAMLError:
            raise ValueError(f"override {item!r}: {raw!r} is not a valid value (YAML)") from None
    return data


def field_annotation(parts: list[str]) -> Any:
    """The annotation of the RunConfig field ``a.b.c`` names, or None for an unknown key (validation names it)."""
    model: type[BaseModel] = RunConfig
    for index, part in enumerate(parts):
        field = model.model_fields.get(part)
        if field is None:
            return None
        annotation = field.annotation
        if index == len(parts) - 1:
            return annotation
        section = _section_model(annotation)
        if section is None:
            return None
        model = section
    return None


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The config section a field holds (``X`` or ``X | None``), or None for a plain value."""
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _text_choices(annotation: Any) -> bool:
    """True for ``str``, ``Literal`` of strings only, and either of them ``| None``."""
    if annotation is str:
        return True
    if get_origin(annotation) is Literal:
        return all(isinstance(choice, str) for choice in get_args(annotation))
    args = get_args(annotation)
    if type(None) in args:
        rest = [arg for arg in args if arg is not type(None)]
        return len(rest) == 1 and _text_choices(rest[0])
    return False


def parse_override_value(annotation: Any, raw: str) -> Any:
    """``raw`` as the value a field of type ``annotation`` takes (see ``apply_overrides``)."""
    if annotation is not None and _text_choices(annotation):
        optional = type(None) in get_args(annotation)
        if optional and raw.strip() in ("null", "~", "None"):
            return None
        value = yaml.safe_load(raw) if raw[:1] in ("'", '"') else raw  # quoted values ('{problem}?') still unquote
        return value if isinstance(value, str) else raw
    return yaml.safe_load(raw)


BASE_KEY = "base"  # a config file's base: another file (relative to it) whose values this one overrides


def load_run_config(
    path: str | Path | list[str | Path] | tuple[str | Path, ...] | None = None, overrides: list[str] | None = None
) -> RunConfig:
    """Load YAML/JSON config files (or defaults), deep-merged in order, and apply dotted overrides.

    A file may name a ``base:`` file (relative to itself), loaded first and overridden by the file's own keys:
    recipes are a base plus a small delta. Raises ValueError naming the file or the field on any user error
    (``describe_config_error`` makes it one line).
    """
    paths = [] if path is None else [path] if isinstance(path, str | Path) else list(path)
    data: dict[str, Any] = {}
    for each in paths:
        data = deep_merge(data, read_config_file(Path(each)))
    return RunConfig.model_validate(apply_overrides(data, overrides or []))


def read_config_file(path: Path, _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """One config file as a dict, its ``base`` chain merged under it."""
    resolved = path.resolve()
    if resolved in _chain:
        raise ValueError(f"config file {path}: its base chain loops back to itself")
    try:
        loaded = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"config file {path} does not exist") from None
    except yaml.YAMLError as error:
        raise ValueError(f"config file {path} is not valid YAML: {str(error).splitlines()[0]}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"config file {path} must hold a mapping at the top level")
    base = loaded.pop(BASE_KEY, None)
    if base is None:
        return loaded
    if not isinstance(base, str):
        raise ValueError(f"config file {path}: '{BASE_KEY}' must be a file path, got {base!r}")
    return deep_merge(read_config_file(path.parent / base, (*_chain, resolved)), loaded)


def deep_merge(base: dict[str, Any], delta: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``delta`` on top: sections merge key by key, any other value replaces."""
    merged = dict(base)
    for key, value in delta.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def describe_config_error(error: ValueError) -> str:
    """One line for a user: each failing field with its message (pydantic's report is one line per detail)."""
    from pydantic import ValidationError

    if isinstance(error, ValidationError):
        return "; ".join(
            f"{'.'.join(str(part) for part in detail['loc']) or 'config'}: {detail['msg']}" for detail in error.errors()
        )
    return str(error).replace("\n", " ")
