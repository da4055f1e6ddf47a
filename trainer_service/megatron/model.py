"""Model and optimizer setup of the Megatron backend: the bridge's provider configured, wrapped, optimized.

``build_model`` turns an ``AutoBridge`` (from the HF checkpoint or config) into megatron-core model chunks wrapped
in DDP plus megatron-core's optimizer (distributed over the data-parallel ranks when configured). The provider
settings are the CPU-safe ones: the local (non-TE) layer spec and no fusions that need TE or apex; MoE experts
are ``GroupedExperts`` (grouped matmuls, ``trainer.megatron.moe_grouped_experts``) or megatron-core's
``SequentialMLP``.
"""

from __future__ import annotations

from functools import partial

import torch

from protos.config import MegatronConfig, TrainerConfig
from trainer_service.megatron import cpu_shims
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
    if not getattr(provider, "has_local_layer_spec", False):
        provider.transformer_layer_spec = local_layer_spec
    provider.persist_layer_norm = False
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
    provider.moe_permute_fusion = False  # the bridge turns it on; it needs TE
    provider.moe_enable_routing_replay = config.routing_replay
    # Only routers with an expert bias (Beam) read it.
    provider.moe_router_bias_update_rate = config.moe_router_bias_update_rate
    # RL trains on the policy loss alone: no load-balancing term unless asked for.
    provider.moe_aux_loss_coeff = config.moe_aux_loss_coeff
    if config.moe_aux_loss_coeff == 0.0:
        provider.moe_router_load_balancing_type = "none"


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
    """megatron-core's Adam over the model chunks (the distributed optimizer when configured)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    return get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=config.lr,
            min_lr=config.lr,
            weight_decay=config.weight_decay,
            adam_beta1=0.9,
            adam_beta2=0.99,
            adam_eps=1e-8,
            clip_grad=config.grad_clip,
            bf16=bf16,
            params_dtype=DTYPES[config.megatron.params_dtype],
            use_distributed_optimizer=config.megatron.use_distributed_optimizer,
        ),
        model,
    )
