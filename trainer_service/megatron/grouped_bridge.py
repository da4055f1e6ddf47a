"""HF import and export of ``GroupedExperts`` through megatron-bridge's own per-expert mappings.

megatron-bridge maps ``SequentialMLP`` experts one by one: ``...experts.local_experts.*.linear_fc1.weight`` <->
that expert's gate and up tensors (``GatedMLPMapping``), ``...linear_fc2.weight`` <-> its down tensor (row
parallel). Those mappings do the expert-tensor-parallel split and gather, the gather over expert-parallel ranks
under each expert's global number, and the broadcast from the expert's pipeline stage. ``GroupedExpertsMapping``
maps one grouped weight (``...experts.fc1.weight`` [E, N, K]) by running exactly those mappings on each local
expert's [N, K] slice, in expert order on every rank, so import reads and export writes the tensors the
``SequentialMLP`` path does; on export each expert's LoRA adapter is folded in first
(``grouped_lora.merged_expert_weight``).

``GroupedExpertsAutoBridge`` (what ``MegatronBackend`` builds) adds a grouped mapping next to every per-expert
one of the model bridge megatron-bridge picks for the checkpoint (its Qwen3-MoE bridge, fleetrl's Beam bridge).
"""

from __future__ import annotations

import torch
from megatron.bridge import AutoBridge
from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
from megatron.bridge.models.conversion.param_mapping import (
    AutoMapping,
    ColumnParallelMapping,
    MegatronParamMapping,
    RowParallelMapping,
)

from trainer_service.megatron.grouped_lora import merged_expert_weight

# Per-expert projection -> the GroupedExperts attribute holding it, and its parallel layout (megatron-bridge's
# AutoMapping would read the layout off a ColumnParallelLinear / RowParallelLinear module).
_PROJECTIONS = {"linear_fc1": ("fc1", ColumnParallelMapping), "linear_fc2": ("fc2", RowParallelMapping)}
# HF config fields that hold the routed-expert count (the names megatron-bridge maps to num_moe_experts).
_NUM_EXPERTS_FIELDS = ("num_experts", "n_routed_experts", "num_local_experts")


class _OneExpert(torch.nn.Module):
    """What a per-expert mapping reads of its megatron module: ``config`` and that expert's ``weight`` [N, K]."""

    def __init__(self, linear, expert: int):
        super().__init__()
        self.config = linear.config
        self.weight = linear.weight.detach()[expert]

    def __getattr__(self, name: str):
        # Mappings of the grouped GEMM form look the expert up as ``weight<number>``.
        if name.startswith("weight") and name[len("weight") :].isdigit():
            return self.weight
        return super().__getattr__(name)


class GroupedExpertsMapping(MegatronParamMapping):
    """One grouped expert weight [E, N, K] <-> its E local experts' HF tensors, through the per-expert mapping.

    Built per layer by ``resolve``: ``experts`` are the per-expert mapping resolved for this rank's local experts
    (global numbers ``ep_rank * E + e``); ``hf_param`` lists their HF names, keyed ``"<e>"`` or ``"<e>.<key>"``.
    """

    def __init__(self, megatron_param: str, expert_mapping, expert_wildcard: int, num_experts: int, layout, experts=()):
        self.expert_mapping = expert_mapping
        self.expert_wildcard = expert_wildcard
        self.num_experts = num_experts
        self.layout = layout
        self.experts = list(experts)
        super().__init__(megatron_param, expert_mapping.hf_param if not experts else self._hf_names(self.experts))

    @staticmethod
    def _hf_names(experts: list) -> dict[str, str]:
        names = {}
        for local, expert in enumerate(experts):
            if isinstance(expert.hf_param, str):
                names[str(local)] = expert.hf_param
            else:
                names.update({f"{local}.{key}": name for key, name in expert.hf_param.items()})
        return names

    def _validate_patterns(self):
        """The HF side has one wildcard more (the expert) until ``resolve`` lists the names."""

    def set_process_groups_from_pg_collection(self, pg_collection) -> None:
        super().set_process_groups_from_pg_collection(pg_collection)
        for expert in self.experts:
            expert.set_process_groups_from_pg_collection(pg_collection)

    def resolve(self, captures: tuple[str, ...]) -> GroupedExpertsMapping:
        megatron_param = self.megatron_param
        for capture in captures:
            megatron_param = megatron_param.replace("*", capture, 1)
        per_rank = self.num_experts // self.ep_size
        experts = []
        for local in range(per_rank):
            global_number = str(self.ep_rank * per_rank + local)
            expert_captures = (*captures[: self.expert_wildcard], global_number, *captures[self.expert_wildcard :])
            expert = self.expert_mapping.resolve(expert_captures)
            if isinstance(expert, AutoMapping):
                if expert.permute_dims is not None:
                    raise ValueError(f"{expert.megatron_param}: permuted expert weights are not supported")
                expert = self.layout(expert.megatron_param, expert.hf_param)
            experts.append(expert)
        return GroupedExpertsMapping(
            megatron_param, self.expert_mapping, self.expert_wildcard, self.num_experts, self.layout, experts
        )

    def hf_to_megatron(self, hf_weights: dict, megatron_module) -> torch.Tensor:
        shards = []
        for local, expert in enumerate(self.experts):
            if isinstance(expert.hf_param, str):
                weights = hf_weights[str(local)]
            else:
                weights = {key: hf_weights[f"{local}.{key}"] for key in expert.hf_param}
            shards.append(expert.hf_to_megatron(weights, _OneExpert(megatron_module, local)))
        return torch.stack(shards)

    def megatron_to_hf(self, megatron_weights, megatron_module) -> dict[str, torch.Tensor]:
        # Every rank runs every expert's mapping in the same order: their collectives pair up across ranks.
        converted = {}
        for local, expert in enumerate(self.experts):
            if megatron_module is None:  # another pipeline stage holds the layer; the mapping receives it
                converted.update(expert.megatron_to_hf(None, None))
                continue
            weight_NK = merged_expert_weight(megatron_module, local)
            converted.update(expert.megatron_to_hf(weight_NK, _OneExpert(megatron_module, local)))
        return converted


def with_grouped_expert_mappings(registry: MegatronMappingRegistry, num_experts: int) -> MegatronMappingRegistry:
    """``registry`` plus a ``GroupedExpertsMapping`` for each of its per-expert (``SequentialMLP``) mappings."""
    grouped = []
    for mapping in registry.mappings:
        for projection, (attribute, layout) in _PROJECTIONS.items():
            prefix = _per_expert_prefix(mapping.megatron_param, projection)
            if prefix is None:
                continue
            grouped_param = f"{prefix}.experts.{attribute}.weight"
            grouped.append(GroupedExpertsMapping(grouped_param, mapping, prefix.count("*"), num_experts, layout))
    return MegatronMappingRegistry(*registry.mappings, *grouped)


def _per_expert_prefix(megatron_param: str, projection: str) -> str | None:
    """The layer prefix of a per-expert mapping of ``projection``, else None. Two forms name the expert: the
    ``SequentialMLP`` one (``experts.local_experts.*.linear_fc1.weight``) and the one of bridges written for grouped
    GEMM experts (``experts.linear_fc1.weight*``, DeepSeek-V3's, GLM-4.5's); in both the expert's wildcard follows
    the layer's. Fused HF expert tensors (one [E, ...] tensor per layer) are not per-expert mappings."""
    if "**" in megatron_param:
        return None
    for per_expert in (f".experts.local_experts.*.{projection}.weight", f".experts.{projection}.weight*"):
        if megatron_param.endswith(per_expert):
            return megatron_param[: -len(per_expert)]
    return None


def num_routed_experts(hf_config) -> int | None:
    """The checkpoint's routed-expert count (None for a dense model)."""
    return next((getattr(hf_config, field) for field in _NUM_EXPERTS_FIELDS if getattr(hf_config, field, None)), None)


class GroupedExpertsAutoBridge(AutoBridge):
    """``AutoBridge`` whose model bridge also maps ``GroupedExperts`` weights (to the same HF tensors)."""

    @property
    def _model_bridge(self):
        model_bridge = super()._model_bridge
        num_experts = num_routed_experts(model_bridge.hf_config)
        if num_experts:
            per_expert_registry = model_bridge.mapping_registry
            model_bridge.mapping_registry = lambda: with_grouped_expert_mappings(per_expert_registry(), num_experts)
        return model_bridge
