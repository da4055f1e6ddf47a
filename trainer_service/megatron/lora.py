"""LoRA for the Megatron backend: megatron-bridge's PEFT ``LoRA`` applied as a pre-wrap hook.

The hook runs after the bridge's own hook has loaded the HF weights and before DDP wraps the model, so the
base weights are frozen and DDP / the distributed optimizer allocate gradient buffers and Adam state for the
adapters only. ``AutoBridge.export_hf_weights`` merges the adapters into the base weights on export
(``merge_adapter_weights``, or ``grouped_bridge`` for grouped experts); ``trainer_service.lora.published`` then
keeps the adapted layers.
"""

from __future__ import annotations

import importlib.util

from protos.config import LoraConfig


def _te_paths_off_without_transformer_engine() -> None:
    """Without Transformer Engine, make the bridge's PEFT take its megatron-core (local spec) code paths.

    fleetrl builds models with the local layer spec; where TE is not installed, megatron-core's TE extension
    module is a stand-in (cpu_shims), whose classes the bridge then counts as present
    (``peft.utils.HAVE_TE`` true) and fails in ``isinstance`` on.
    """
    if importlib.util.find_spec("transformer_engine") is not None:
        return
    from megatron.bridge.peft import module_matcher, utils

    utils.HAVE_TE = False
    module_matcher.HAVE_TE = False


def lora_pre_wrap_hook(config: LoraConfig, grouped_experts: bool):
    """A ``provider.register_pre_wrap_hook`` callable that adds LoRA adapters to every model chunk.

    megatron-bridge's ``LoRA`` freezes the base and wraps every targeted linear (with ``SequentialMLP`` experts,
    one adapter module per expert); with ``grouped_experts`` the experts' projections are not linears it wraps,
    and ``grouped_lora`` gives each its batched adapter instead.
    """
    from megatron.bridge.peft.lora import LoRA

    _te_paths_off_without_transformer_engine()
    peft = LoRA(
        target_modules=list(config.target_modules),
        dim=config.rank,
        alpha=config.alpha,
        dropout=config.dropout,
        # Kaiming-uniform A and zero B, as PEFT and the torch backend: step 0 is exactly the base model.
        lora_A_init_method="kaiming",
        lora_B_init_method="zero",
        # One adapter per expert, as the torch backend and the per-expert HF layout.
        share_expert_adapters=False,
        normalize_moe_lora=config.normalize_moe_lora,
    )

    def apply(model_chunks: list) -> list:
        if _has_bridge_targets(model_chunks, config):
            model_chunks = peft(model_chunks, training=True)
        else:  # only grouped experts are adapted: nothing for the bridge to wrap, the base is frozen here
            for parameter in (p for chunk in model_chunks for p in chunk.parameters()):
                parameter.requires_grad_(False)
        if grouped_experts:
            from trainer_service.megatron.grouped_lora import add_grouped_adapters

            add_grouped_adapters(model_chunks, config)
        return model_chunks

    return apply


def _has_bridge_targets(model_chunks: list, config: LoraConfig) -> bool:
    """Whether megatron-bridge's ``LoRA`` matches a module (it matches by the module's own name)."""
    targets = set(config.target_modules)
    return any(name.rpartition(".")[2] in targets for chunk in model_chunks for name, _ in chunk.named_modules())
