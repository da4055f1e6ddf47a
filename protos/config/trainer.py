"""The trainer's section: backend, loss, optimizer, checkpoints, Megatron layout, LoRA."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from protos.config.base import Strict


class MegatronConfig(Strict):
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
    moe_grouped_gemm: bool = Field(
        False,
        description="megatron-core's Transformer Engine grouped GEMM (TEGroupedMLP); fleetrl builds the local "
        "(non-TE) spec, which ignores it: keep False and use moe_grouped_experts.",
    )
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
    moe_grouped_experts: bool = Field(
        True,
        description="Experts as GroupedExperts: all local experts in one grouped matmul per projection "
        "(torch._grouped_mm where the device and dtype have it, else a per-expert loop), forward and backward; "
        "False: megatron-core's per-expert SequentialMLP. Same numerics and the same HF export either way.",
    )
    moe_grouped_lora: bool = Field(
        True,
        description="With moe_grouped_experts and LoRA on linear_fc1/linear_fc2: one batched adapter per expert "
        "projection, applied with grouped matmuls; False builds SequentialMLP experts with one adapter module "
        "per expert (megatron-bridge's) for LoRA runs.",
    )
    export_plan: bool = Field(
        True,
        description="One process (world size 1, no LoRA): learn once how megatron-bridge's HF export maps onto the "
        "parameters (views, fixed row selections; trainer_service.export_plan) and export later versions through "
        "that plan instead of the bridge, compared with a bridge export every 100 versions; false: the bridge always.",
    )
    fused_attention: bool = Field(
        True,
        description="Core attention through torch's scaled_dot_product_attention (FlashAttention on a GPU; sliding "
        "windows in blocks) with no [T, T] mask for right-padded batches; False: megatron-core's eager attention.",
    )
    recompute: Literal["none", "selective", "full"] = Field(
        "none",
        description="Activation recompute: 'selective' re-runs recompute_modules in the backward, 'full' every "
        "transformer layer (only each layer's input is kept); R3 routes are replayed in the recompute too.",
    )
    recompute_modules: list[Literal["core_attn", "mlp", "moe"]] = Field(
        default_factory=lambda: ["core_attn"],
        min_length=1,
        description="What recompute='selective' re-runs: megatron-core's 'core_attn', 'mlp' (dense MLP), 'moe' (the "
        "MoE layer, router included). Its output-discarding ones ('layernorm', 'moe_act') need Transformer Engine.",
    )
    fused_adam: bool = Field(
        True,
        description="torch's fused AdamW kernel for megatron-core's torch AdamW (used without Transformer Engine "
        "and apex); False: torch's default (foreach on a GPU).",
    )
    optimizer_cpu_offload: bool = Field(
        False,
        description="Keep optimizer_offload_fraction of the fp32 main weights and Adam moments in host memory and "
        "step them there (megatron-core's HybridDeviceOptimizer); needs CUDA, bfloat16 params and "
        "use_distributed_optimizer.",
    )
    optimizer_offload_fraction: float = Field(
        1.0, gt=0.0, le=1.0, description="Share of the optimizer state offloaded when optimizer_cpu_offload is on."
    )
    optimizer_state_disk_dir: str = Field(
        "",
        description="With optimizer_cpu_offload: a node-local disk directory (NVMe) that the offloaded state is "
        "streamed from and to (the launch guide's full fine-tuning); '' = host memory (about 1.7 TB per node for "
        "Beam). Disk streaming is not implemented by this trainer yet: it refuses a directory at start. Env alias "
        "OPTIMIZER_STATE_DISK_DIR.",
    )

    @model_validator(mode="after")
    def _offload_needs_the_distributed_optimizer(self) -> MegatronConfig:
        if self.optimizer_cpu_offload and not self.use_distributed_optimizer:
            raise ValueError(
                "trainer.megatron.optimizer_cpu_offload needs trainer.megatron.use_distributed_optimizer=true "
                "(megatron-core wires its HybridDeviceOptimizer into the distributed optimizer only)"
            )
        if self.optimizer_cpu_offload and self.params_dtype != "bfloat16":
            raise ValueError(
                "trainer.megatron.optimizer_cpu_offload needs trainer.megatron.params_dtype='bfloat16' (it offloads the "
                "fp32 main copies of bf16 weights; megatron-core cannot offload fp32 params, which have none)"
            )
        if self.optimizer_state_disk_dir and not self.optimizer_cpu_offload:
            raise ValueError(
                "trainer.megatron.optimizer_state_disk_dir is set but trainer.megatron.optimizer_cpu_offload is false: "
                "set optimizer_cpu_offload=true (the directory then holds the offloaded state) or clear the directory"
            )
        return self


class LoraConfig(Strict):
    """Low-rank adapters (LoRA): the base weights stay frozen and only ``A`` [r, in] / ``B`` [out, r] train.

    Module names are megatron-core's, which both backends understand: ``linear_qkv`` (HF q_proj, k_proj, v_proj),
    ``linear_proj`` (o_proj), ``linear_fc1`` (gate_proj + up_proj, dense MLP and every routed expert),
    ``linear_fc2`` (down_proj). Routers, norms, embeddings and the LM head are never adapted. The trainer
    publishes either the merged weights ``W + alpha / r * B @ A`` of the adapted modules only (the rest of a
    rollout server's weights never change from the base checkpoint) or the adapters alone (``sync``).
    """

    rank: int = Field(0, ge=0, description="Adapter rank r; 0 = full fine-tuning (no LoRA).")
    alpha: float = Field(32.0, gt=0, description="Scale numerator: the update is alpha / rank * B @ A.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter's input (training only).")
    target_modules: list[Literal["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]] = Field(
        default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
        min_length=1,
        description="Adapted modules (megatron-core names; see the class docstring for the HF ones).",
    )
    normalize_moe_lora: bool = Field(
        False,
        description="Routed experts' adapters get rank / top_k (rank must divide by the router's top_k), "
        "with the scale alpha / (rank / top_k): a token's top_k experts together hold one dense adapter's rank.",
    )
    sync: Literal["merged", "adapters"] = Field(
        "merged",
        description="What each published version carries to the rollout servers. 'merged': the merged weights of "
        "the adapted layers (any engine). 'adapters': the adapters alone (PEFT A / B, staged through pinned host "
        "memory on a GPU), served in vLLM's LoRA slot on the frozen base (rollout.lora); the CPU engine serves "
        "them for dense models only (docs/rollout_service.md, 'LoRA adapters').",
    )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @model_validator(mode="after")
    def _normalizing_needs_adapters(self) -> LoraConfig:
        if self.normalize_moe_lora and not self.enabled:
            raise ValueError("trainer.lora.normalize_moe_lora needs trainer.lora.rank > 0 (LoRA on)")
        if self.sync == "adapters" and not self.enabled:
            raise ValueError("trainer.lora.sync='adapters' needs trainer.lora.rank > 0 (LoRA on); or set it 'merged'")
        if self.normalize_moe_lora and not {"linear_fc1", "linear_fc2"} & set(self.target_modules):
            raise ValueError(
                "trainer.lora.normalize_moe_lora sizes expert adapters: add linear_fc1 or linear_fc2 to "
                "trainer.lora.target_modules, or set it false"
            )
        return self


class TrainerConfig(Strict):
    """The trainer role: queue consumption, loss, optimizer, weight publishing."""

    backend: Literal["torch", "megatron"] = Field("torch", description="Training backend.")
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
        1,
        ge=0,
        description="Steps between checkpoints (and the last step); queue entries are acknowledged only at a "
        "checkpoint. 0 turns saving off: the entries are then acknowledged after the last step (see "
        "docs/trainer_service.md, 'Checkpoints off').",
    )
    keep_last_checkpoints: int = Field(2, gt=0, description="Checkpoints kept on disk (older ones are deleted).")
    ckpt_dir: str = Field(
        "", description="Checkpoint directory; '' = <out_dir>/checkpoints (runs/<run_id>/... without out_dir)."
    )
    resume: Literal["latest", "none", "from_path"] = Field(
        "latest",
        description="'latest': resume from the newest checkpoint in the checkpoint directory, if any; 'none': start "
        "from model_path; 'from_path': resume from trainer.resume_path. Env alias RESUME_MODE.",
    )
    metrics_port: int = Field(0, ge=0, description="Prometheus /metrics port of the trainer; 0 = off.")
    fused_lm_head_logprobs: bool = Field(
        True,
        description="Score the targets through the LM head in tiles (trainer_service.fused_logprobs): the [T, V] "
        "logits never exist beyond one tile; soft-cap and per-row temperature included. False: whole logits.",
    )
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
    resume_path: str = Field(
        "", description="The checkpoint directory (step-NNNNNN) trainer.resume='from_path' resumes from."
    )

    @field_validator("resume", mode="before")
    @classmethod
    def _resume_is_a_mode(cls, value: object) -> object:
        if isinstance(value, str) and value not in ("latest", "none", "from_path") and ("/" in value or "." in value):
            raise ValueError(
                f"trainer.resume={value!r} looks like a path: set trainer.resume=from_path and "
                f"trainer.resume_path={value}"
            )
        return value

    @model_validator(mode="after")
    def _resume_path_fits_mode(self) -> TrainerConfig:
        if self.resume == "from_path" and not self.resume_path:
            raise ValueError("trainer.resume='from_path' needs trainer.resume_path=<checkpoint dir>")
        if self.resume_path and self.resume != "from_path":
            raise ValueError(
                f"trainer.resume_path is set but trainer.resume={self.resume!r}: set trainer.resume=from_path "
                "(or clear resume_path)"
            )
        return self

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
