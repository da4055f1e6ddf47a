"""Adapter-only export of the Megatron backend (``trainer.lora.sync='adapters'``): the adapters in PEFT names.

Two kinds of adapter, one stream (every rank iterates it, as ``export_hf_weights``; all get every tensor):

- megatron-bridge's LoRA modules (attention, dense MLP, ``SequentialMLP`` experts): ``AutoBridge.
  export_adapter_weights`` gathers them over TP / PP / EP and splits the fused ones into HF modules (q / k / v
  take their rows of ``linear_qkv``'s B and share its A; gate / up likewise).
- Grouped expert adapters (``grouped_lora``): each ``GroupedExperts`` projection's A [E_local, R, K] and
  B [E_local, N, R], gathered over the expert-parallel ranks (global expert ``ep_rank * E_local + e``), broadcast
  from the pipeline stage holding the layer, and named per expert through the model bridge's per-expert mappings.
  fc1's B splits into gate rows then up rows (the per-expert ``GatedMLPMapping`` layout at expert TP 1, which
  grouped LoRA requires); both take fc1's A.

B is scaled for vLLM (``lora.vllm_lora_b``): expert adapters of rank ``rank / top_k`` carry the factor ``top_k``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from protos.config import LoraConfig
from trainer_service import lora
from trainer_service.megatron.grouped_experts import GroupedExperts
from trainer_service.megatron.grouped_lora import expert_rank

# GroupedExperts attribute -> the per-expert megatron-core module its mapping is registered under.
_PER_EXPERT = {"fc1": "linear_fc1", "fc2": "linear_fc2"}


def export_adapter_weights(bridge, model_chunks: list, config: LoraConfig, cpu: bool) -> Iterator:
    """(PEFT name, tensor) of every adapter: the bridge's first, then the grouped experts', in layer order."""
    for name, tensor in bridge.export_adapter_weights(model_chunks, cpu=cpu, show_progress=False):
        scaled = lora.vllm_lora_b(tensor, config) if name.endswith(".lora_B.weight") else tensor
        yield lora.PEFT_PREFIX + name, scaled
    registry = bridge._model_bridge.mapping_registry()
    for layer, projection, lora_a_ERK, lora_b_ENR in _gathered_grouped_adapters(model_chunks):
        if cpu:
            lora_a_ERK, lora_b_ENR = lora_a_ERK.cpu(), lora_b_ENR.cpu()
        lora_b_ENR = lora.vllm_lora_b(lora_b_ENR, config)
        for expert in range(lora_a_ERK.shape[0]):
            mapping = registry.megatron_to_hf_lookup(
                f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.{_PER_EXPERT[projection]}.weight"
            )
            if mapping is None:
                raise ValueError(f"layer {layer} expert {expert}: the model bridge maps no per-expert {projection}")
            yield from _expert_tensors(mapping.hf_param, lora_a_ERK[expert], lora_b_ENR[expert])


def _expert_tensors(hf_param, lora_a_RK: torch.Tensor, lora_b_NR: torch.Tensor) -> Iterator:
    """One expert's adapter under its HF module(s): fc1 {"gate", "up"} splits B's rows, fc2 is one module."""
    if isinstance(hf_param, str):
        yield from zip(lora.peft_names(hf_param.removesuffix(".weight")), (lora_a_RK, lora_b_NR), strict=True)
        return
    gate_NR, up_NR = torch.chunk(lora_b_NR, 2, dim=0)
    for key, lora_b in (("gate", gate_NR), ("up", up_NR)):
        yield from zip(lora.peft_names(hf_param[key].removesuffix(".weight")), (lora_a_RK, lora_b), strict=True)


def _local_grouped_adapters(model_chunks: list) -> list[tuple[int, str, object]]:
    """(global layer index, fc1 | fc2, adapter) of every grouped expert adapter on this rank, in layer order."""
    found = []
    for chunk in model_chunks:
        for module in chunk.modules():
            experts = getattr(getattr(module, "mlp", None), "experts", None)
            if not isinstance(experts, GroupedExperts) or not hasattr(module, "layer_number"):
                continue
            for projection in _PER_EXPERT:
                adapter = getattr(experts, projection).adapter
                if adapter is not None:  # layer_number: megatron-core's global, 1-based
                    found.append((module.layer_number - 1, projection, adapter))
    return sorted(found, key=lambda item: (item[0], item[1]))


def _gathered_grouped_adapters(model_chunks: list) -> Iterator[tuple[int, str, torch.Tensor, torch.Tensor]]:
    """(layer, projection, A [E, R, K], B [E, N, R]) with every expert, on every rank, in layer order."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    local = {(layer, projection): adapter for layer, projection, adapter in _local_grouped_adapters(model_chunks)}
    ep_group, ep_size = mpu.get_expert_model_parallel_group(), mpu.get_expert_model_parallel_world_size()
    pp_group, pp_size = mpu.get_pipeline_model_parallel_group(), mpu.get_pipeline_model_parallel_world_size()
    # What each stage holds: (layer, projection) -> (shape of A, shape of B) with every expert, dtype.
    held = {
        key: ((ep_size * a.lora_a.shape[0], *a.lora_a.shape[1:]), (ep_size * a.lora_b.shape[0], *a.lora_b.shape[1:]))
        for key, a in local.items()
    }
    owners = [(mpu.get_pipeline_model_parallel_rank(), held)]
    if pp_size > 1:
        owners = [None] * pp_size
        dist.all_gather_object(owners, (mpu.get_pipeline_model_parallel_rank(), held), group=pp_group)
    layout = {key: (stage, shapes) for stage, stage_held in owners for key, shapes in stage_held.items()}
    device, dtype = _device_and_dtype(model_chunks)
    for key in sorted(layout):
        stage, (shape_a, shape_b) = layout[key]
        if key in local:
            tensors = [_all_experts(t.detach(), ep_group, ep_size) for t in (local[key].lora_a, local[key].lora_b)]
        else:
            tensors = [torch.empty(shape, dtype=dtype, device=device) for shape in (shape_a, shape_b)]
        if pp_size > 1:
            source = dist.get_global_rank(pp_group, stage)
            for tensor in tensors:
                dist.broadcast(tensor, src=source, group=pp_group)
        yield key[0], key[1], tensors[0], tensors[1]


def _all_experts(local_E: torch.Tensor, ep_group, ep_size: int) -> torch.Tensor:
    """A per-local-expert tensor [E_local, ...] gathered over the expert-parallel ranks into [E, ...]."""
    if ep_size == 1:
        return local_E.contiguous()
    import torch.distributed as dist

    parts = [torch.empty_like(local_E) for _ in range(ep_size)]
    dist.all_gather(parts, local_E.contiguous(), group=ep_group)
    return torch.cat(parts)


def _device_and_dtype(model_chunks: list) -> tuple[torch.device, torch.dtype]:
    parameter = next(p for chunk in model_chunks for p in chunk.parameters() if p.requires_grad)
    return parameter.device, parameter.dtype


def expert_adapter_rank(model_chunks: list, config: LoraConfig) -> int:
    """The routed experts' adapter rank (``rank / top_k`` with normalize_moe_lora); 0 when none is adapted."""
    from megatron.core.utils import get_model_config

    model_config = get_model_config(model_chunks[0])
    if not model_config.num_moe_experts or not {"linear_fc1", "linear_fc2"} & set(config.target_modules):
        return 0
    return expert_rank(config, model_config.moe_router_topk)
