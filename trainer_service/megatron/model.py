"""Model and optimizer setup of the Megatron backend: the bridge's provider configured, wrapped, optimized.

``build_model`` turns an ``AutoBridge`` (from the HF checkpoint or config) into megatron-core model chunks wrapped
in DDP plus megatron-core's optimizer (distributed over the data-parallel ranks when configured). The provider
settings are the CPU-safe ones: the local (non-TE) layer spec and no fusions that need TE or apex; MoE experts
are ``GroupedExperts`` (grouped matmuls, ``trainer.megatron.moe_grouped_experts``) or megatron-core's
``SequentialMLP``. The switches of ``trainer.megatron`` that need neither TE nor apex act here too: the fused core
attention in the spec, activation recompute, torch's fused AdamW and the optimizer's CPU offload
(docs/trainer_service.md, "Speed and memory switches").
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch

from protos.config import MegatronConfig, TrainerConfig
from trainer_service.megatron import checkpoint as megatron_checkpoint
from trainer_service.megatron import cpu_shims, zero_centered_norm
from trainer_service.megatron import lora as megatron_lora

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def configure_provider(provider, config: MegatronConfig, on_cpu: bool, grouped_experts: bool = False) -> None:
    """Model settings: the local (non-TE) layer spec, no fusions that need TE/apex, the policy loss alone.

    ``grouped_experts``: MoE layers get ``GroupedExperts`` instead of ``SequentialMLP`` (``uses_grouped_experts``).
    """
    from megatron.bridge.models.gpt_provider import local_layer_spec

    dtype = DTYPES[config.params_dtype]
    provider.tensor_model_parallel_size = config.tensor_model_parallel_size
    provider.pipeline_model_parallel_size = config.pipeline_model_parallel_size
    provider.expert_model_parallel_size = config.expert_model_parallel_size
    if config.expert_tensor_parallel_size is not None:  # None: megatron's default, the TP size
        provider.expert_tensor_parallel_size = config.expert_tensor_parallel_size
    provider.context_parallel_size = config.context_parallel_size
    # MoE with TP > 1 needs sequence parallel in megatron-core.
    provider.sequence_parallel = config.tensor_model_parallel_size > 1
    # The bridge defaults to the TE spec, which fails without Transformer Engine; a provider that brings its own
    # local spec (Beam) keeps it.
    zero_centered_norm.install()  # the local spec's norms refuse Nemotron's and Qwen3-Next's (1 + w) norms
    if not getattr(provider, "has_local_layer_spec", False):
        _refuse_hybrid_stack(provider)
        provider.transformer_layer_spec = _local_form(provider.transformer_layer_spec, local_layer_spec)
    provider.persist_layer_norm = False
    # fleetrl trains the policy alone: multi-token-prediction heads (GLM-4.5's, DeepSeek-V3's) get no loss and the
    # engine serves without them, and their spec exists only for Transformer Engine.
    provider.mtp_num_layers = None
    provider.params_dtype = dtype
    provider.pipeline_dtype = dtype
    provider.autocast_dtype = dtype
    provider.bf16 = dtype == torch.bfloat16
    provider.fp16 = False
    _configure_moe(provider, config, grouped_experts)
    provider.gradient_accumulation_fusion = False
    provider.bias_dropout_fusion = False
    provider.masked_softmax_fusion = False
    provider.apply_rope_fusion = False
    provider.cross_entropy_loss_fusion = False
    provider.use_cpu_initialization = on_cpu
    # The pipeline's p2p step ends with torch.cuda.synchronize(); gloo's send/recv are synchronous already.
    provider.batch_p2p_sync = not on_cpu
    _configure_attention_and_recompute(provider, config)


def _refuse_hybrid_stack(provider) -> None:
    """megatron-bridge's hybrid (Mamba) providers (Nemotron-H) build their layers from ``hybrid_stack_spec``, whose
    only stock form is made of Transformer Engine modules, and megatron-core's Mamba mixer runs mamba-ssm's CUDA
    kernels: neither is installed with fleetrl, so such a model cannot be built here. Say so before building."""
    if hasattr(provider, "hybrid_stack_spec"):
        raise ValueError(
            f"model_path: {type(provider).__name__} (a hybrid Mamba model) is not supported by the Megatron backend:"
            " its layer spec needs Transformer Engine and its Mamba layers the mamba-ssm kernels; use"
            " trainer.backend=torch"
        )


def _local_form(spec, local_layer_spec):
    """The provider's spec without Transformer Engine. A block spec (DeepSeek-V3's, GLM-4.5's) keeps its per-layer
    layout (dense first layers, ``moe_layer_freq``) built from local modules; any other becomes the local spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    if isinstance(spec, partial) and spec.func is get_gpt_decoder_block_spec:
        return partial(spec, use_transformer_engine=False)
    if getattr(spec, "__name__", "") == "get_transformer_block_with_experimental_attention_variant_spec":
        # Qwen3-Next's and Qwen3.5's gated-DeltaNet layers: megatron-core builds this block for TE only, and the
        # local spec would silently make every layer full attention.
        raise ValueError(
            "model_path: gated-DeltaNet (linear attention) layers are not supported by the Megatron backend:"
            " megatron-core builds them from Transformer Engine modules only; use trainer.backend=torch"
        )
    return local_layer_spec


def uses_grouped_experts(config: TrainerConfig) -> bool:
    """Whether the experts are ``GroupedExperts``: ``moe_grouped_experts``, unless a LoRA run adapts the experts
    and ``moe_grouped_lora`` is off (megatron-bridge's per-expert adapters need ``SequentialMLP`` experts)."""
    if not config.megatron.moe_grouped_experts:
        return False
    adapts_experts = config.lora.enabled and bool({"linear_fc1", "linear_fc2"} & set(config.lora.target_modules))
    return config.megatron.moe_grouped_lora or not adapts_experts


def _configure_moe(provider, config: MegatronConfig, grouped_experts: bool) -> None:
    if grouped_experts:  # wraps the spec chosen above (the stock local spec or the provider's own, Beam's)
        from trainer_service.megatron.grouped_experts import grouped_experts_spec

        provider.transformer_layer_spec = partial(grouped_experts_spec, provider.transformer_layer_spec)
    provider.moe_grouped_gemm = config.moe_grouped_gemm
    provider.moe_token_dispatcher_type = config.moe_token_dispatcher
    # Some providers (DeepSeek-V3, GLM-4.5, Nemotron-H) turn on the shared-expert overlap, which megatron-core
    # refuses with the allgather dispatcher; it only overlaps communication (same numbers), so it goes off there.
    if config.moe_token_dispatcher == "allgather":
        provider.moe_shared_expert_overlap = False
    provider.moe_permute_fusion = False  # the bridge turns it on; it needs TE
    provider.moe_enable_routing_replay = config.routing_replay
    # Only routers with an expert bias (Beam) read it.
    provider.moe_router_bias_update_rate = config.moe_router_bias_update_rate
    # RL trains on the policy loss alone: no load-balancing term unless asked for.
    provider.moe_aux_loss_coeff = config.moe_aux_loss_coeff
    if config.moe_aux_loss_coeff == 0.0:
        provider.moe_router_load_balancing_type = "none"


def _configure_attention_and_recompute(provider, config: MegatronConfig) -> None:
    """The fused core attention in the layer spec (whatever spec the provider has by now), and megatron-core's
    activation recompute: 'full' checkpoints every layer on its own, 'selective' the listed submodules."""
    from trainer_service.megatron.fused_attention import with_fused_core_attention

    if config.fused_attention:
        provider.transformer_layer_spec = with_fused_core_attention(provider.transformer_layer_spec)
    provider.recompute_granularity = None if config.recompute == "none" else config.recompute
    provider.recompute_method = "uniform" if config.recompute == "full" else None
    provider.recompute_num_layers = 1 if config.recompute == "full" else None
    provider.recompute_modules = list(config.recompute_modules)


def build_model(bridge, config: TrainerConfig, on_cpu: bool, load_weights: bool) -> tuple[list, object]:
    """The DDP-wrapped model chunks and their optimizer, wired as megatron.training wires them."""
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.utils import get_model_config

    provider = bridge.to_megatron_provider(load_weights=load_weights)
    grouped_experts = uses_grouped_experts(config)
    configure_provider(provider, config.megatron, on_cpu, grouped_experts)
    provider.finalize()
    if config.lora.enabled:  # after the bridge's weight-loading hook, before DDP wraps the chunks
        provider.register_pre_wrap_hook(megatron_lora.lora_pre_wrap_hook(config.lora, grouped_experts))
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=config.megatron.use_distributed_optimizer
    )
    bf16 = config.megatron.params_dtype == "bfloat16"
    model = provider.provide_distributed_model(
        ddp_config=ddp_config, wrap_with_ddp=True, use_cpu_initialization=on_cpu, bf16=bf16, fp16=False
    )
    with cpu_shims.cuda_tensors_on_cpu():
        optimizer = build_optimizer(config, model, bf16)
    model_config = get_model_config(model[0])
    # What megatron.training wires up: grads reduced after backward, loss scaled by the optimizer.
    model_config.finalize_model_grads_func = finalize_model_grads
    model_config.grad_scale_func = optimizer.scale_loss
    return model, optimizer


def build_optimizer(config: TrainerConfig, model: list, bf16: bool):
    """megatron-core's Adam over the model chunks (the distributed optimizer when configured), with torch's fused
    AdamW kernel (``megatron.fused_adam``) and the optimizer state in host memory (``optimizer_cpu_offload``)."""
    from megatron.core.optimizer import get_megatron_optimizer

    megatron = config.megatron
    if megatron.optimizer_cpu_offload and not torch.cuda.is_available():
        # HybridDeviceOptimizer moves the state of CUDA parameters; on a CPU run there is nothing to move.
        raise ValueError("trainer.megatron.optimizer_cpu_offload needs CUDA: on a CPU run the state is in host memory")
    offload_shards = fp32_shards_as_leaves() if megatron.optimizer_cpu_offload else contextlib.nullcontext()
    with offload_shards:
        optimizer = get_megatron_optimizer(optimizer_config(config, bf16), model)
    if megatron.fused_adam:
        use_fused_adam(optimizer)
    return optimizer


def optimizer_config(config: TrainerConfig, bf16: bool):
    from megatron.core.optimizer import OptimizerConfig

    megatron = config.megatron
    return OptimizerConfig(
        optimizer="adam",
        lr=config.lr,
        min_lr=config.lr,
        weight_decay=config.weight_decay,
        adam_beta1=0.9,
        adam_beta2=0.99,
        adam_eps=1e-8,
        clip_grad=config.grad_clip,
        bf16=bf16,
        params_dtype=DTYPES[megatron.params_dtype],
        use_distributed_optimizer=megatron.use_distributed_optimizer,
        optimizer_cpu_offload=megatron.optimizer_cpu_offload,
        optimizer_offload_fraction=megatron.optimizer_offload_fraction,
    )


@contextlib.contextmanager
def fp32_shards_as_leaves():
    """While the distributed optimizer is built: its shards of fp32 model parameters become leaves.

    megatron-core 0.19.2 takes the shard of an fp32 parameter (Beam's router weight, kept fp32 in a bf16 model) as a
    view taken with grad mode on, which is not a leaf. The plain distributed optimizer assigns its groups to torch's
    Adam directly, unchecked; ``HybridDeviceOptimizer`` (``optimizer_cpu_offload``) passes them through
    ``torch.optim.Optimizer``'s constructor, which refuses them ("can't optimize a non-leaf Tensor"). A detached view
    is a leaf over the same storage, so the optimizer still writes the model parameter in place; its megatron
    attributes (tensor-parallel flags) are carried over. bf16 parameters' fp32 main copies are leaves already
    (clones).
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    stock = DistributedOptimizer.__dict__["_build_model_and_main_param_groups"]

    def build_groups(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, config):
        groups = stock.__func__(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, config)
        leaves = {}
        for shards in groups[3]:  # shard_fp32_groups
            for index, shard in enumerate(shards):
                if not shard.is_leaf:
                    leaf = shard.detach().requires_grad_(shard.requires_grad)
                    leaf.__dict__.update(shard.__dict__)
                    shards[index] = leaves[id(shard)] = leaf
        for group_range in opt_group_ranges:
            orig_group = group_range["orig_group"]
            orig_group["params"] = [leaves.get(id(param), param) for param in orig_group["params"]]
        return groups

    DistributedOptimizer._build_model_and_main_param_groups = classmethod(build_groups)
    try:
        yield
    finally:
        DistributedOptimizer._build_model_and_main_param_groups = stock


def use_fused_adam(optimizer) -> None:
    """Switch megatron-core's torch AdamW to torch's fused kernel, in place; again after a checkpoint load, whose
    param groups bring their own flag.

    Without Transformer Engine or apex, megatron-core 0.19.2 builds ``torch.optim.AdamW`` with torch's default
    implementation (foreach on a GPU, a loop over tensors on a CPU). ``fused`` is a per-group option read at each
    ``step``; its ``step`` counters must live on the parameters' device. TE's or apex's FusedAdam and the CPU-offload
    optimizer (fused already) are left as they are.
    """
    for sub_optimizer in megatron_checkpoint.sub_optimizers(optimizer):
        inner = getattr(sub_optimizer, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        inner.defaults.update(fused=True, foreach=False)
        for group in inner.param_groups:
            group.update(fused=True, foreach=False)
            for param in group["params"]:
                state = inner.state.get(param, {})
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = state["step"].to(device=param.device, dtype=torch.float32)
