"""LoRA for the torch backend, and which HF tensors a LoRA run publishes (both backends).

Torch backend: every targeted weight W [..., out, in] gets a parametrization ``W + alpha / r * B @ A`` with
A [..., r, in] (Kaiming-uniform, as PEFT) and B [..., out, r] (zeros, so step 0 is the base model). The leading
dims cover fused expert tensors (transformers' ``experts.gate_up_proj`` [E, 2I, H]): one adapter per expert, of
rank r / top_k with ``normalize_moe_lora`` (its scale alpha / (r / top_k)).
Base weights are frozen; only A and B train and only they are checkpointed (the base is ``model_path``).

Publishing: vLLM's in-place reload rebuilds a layer from the tensors it receives, so a layer that gets only
some of its tensors is rebuilt with garbage in the rest (vllm model_loader/reload/layerwise.py materialises a
fresh layer). ``is_published`` therefore picks whole vLLM layers: q/k/v together (one QKVParallelLinear), and
a MoE block whole (experts + router + correction bias: FusedMoE holds gate_up and down together) as soon as
either expert projection is adapted. Everything else equals the base checkpoint every server started from.

Adapter-only sync (``trainer.lora.sync='adapters'``): ``adapter_weights`` names each adapter as PEFT does
(``base_model.model.<HF module>.lora_A.weight`` [r, in], ``lora_B.weight`` [out, r]; fused expert tensors split
per expert and gate / up) and ``adapter_record`` describes them; vLLM serves them in its LoRA slot.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn.utils import parametrize

from protos.config import LoraConfig
from protos.records import LoraAdapter

# HF parameter names of each megatron-core target (dense MLP, per-expert modules and fused expert tensors).
_TARGET_PATTERNS = {
    "linear_qkv": re.compile(r"\.self_attn\.[qkv]_proj\.weight$"),
    "linear_proj": re.compile(r"\.self_attn\.o_proj\.weight$"),
    "linear_fc1": re.compile(r"\.mlp\.((experts\.\d+\.)?(gate|up)_proj\.weight|experts\.gate_up_proj)$"),
    "linear_fc2": re.compile(r"\.mlp\.((experts\.\d+\.)?down_proj\.weight|experts\.down_proj)$"),
}
_MOE_BLOCK = re.compile(r"\.mlp\.(experts|gate|shared_expert|shared_expert_gate)\.")
# HF module names of each megatron-core target (what a PEFT adapter_config.json lists).
HF_MODULES = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
PEFT_PREFIX = "base_model.model."
_ROUTED_EXPERTS = re.compile(r"\.mlp\.experts\.")


def target_of(hf_name: str) -> str | None:
    """The megatron-core target a HF parameter belongs to, or None (norms, routers, embeddings, LM head)."""
    for target, pattern in _TARGET_PATTERNS.items():
        if pattern.search(hf_name):
            return target
    return None


def is_published(hf_name: str, target_modules: list[str]) -> bool:
    """Whether a LoRA run sends this HF tensor to the rollout servers (whole vLLM layers, see module doc)."""
    targets = set(target_modules)
    if _MOE_BLOCK.search(hf_name):
        return bool(targets & {"linear_fc1", "linear_fc2"})
    return target_of(hf_name) in targets


class LoraDelta(nn.Module):
    """The parametrization ``W -> W + scale * B @ A``; A and B are the only trainable tensors."""

    def __init__(self, weight: torch.Tensor, rank: int, alpha: float):
        super().__init__()
        *lead, out_features, in_features = weight.shape
        a = torch.empty(*lead, rank, in_features, dtype=weight.dtype, device=weight.device)
        for matrix in a.view(-1, rank, in_features):
            nn.init.kaiming_uniform_(matrix, a=math.sqrt(5))
        self.lora_A = nn.Parameter(a)
        self.lora_B = nn.Parameter(torch.zeros(*lead, out_features, rank, dtype=weight.dtype, device=weight.device))
        self.scale = alpha / rank

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + self.scale * (self.lora_B @ self.lora_A)


def apply_lora(model: nn.Module, config: LoraConfig) -> int:
    """Freeze ``model`` and parametrize every targeted weight; returns the number of adapted tensors."""
    if config.dropout > 0:
        raise ValueError(
            "trainer.lora.dropout: the torch backend adapts weights (W + B @ A), which leaves no adapter input to "
            "drop out; use 0 or trainer.backend='megatron'"
        )
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    targets = set(config.target_modules)
    adapted = [
        (name, module, leaf) for name, module, leaf in _named_leaf_parameters(model) if target_of(name) in targets
    ]
    if not adapted:
        raise ValueError(f"trainer.lora.target_modules {sorted(targets)} match no weight of {type(model).__name__}")
    for name, module, leaf in adapted:
        rank = adapter_rank(config, name, getattr(model.config, "num_experts_per_tok", None))
        parametrize.register_parametrization(module, leaf, LoraDelta(getattr(module, leaf), rank, config.alpha))
    return len(adapted)


def adapter_rank(config: LoraConfig, hf_name: str, top_k: int | None) -> int:
    """``config.rank``; for a routed expert's weight with ``normalize_moe_lora``, ``rank / top_k``."""
    if not (config.normalize_moe_lora and _ROUTED_EXPERTS.search(hf_name)):
        return config.rank
    if not top_k or config.rank % top_k:
        raise ValueError(
            f"trainer.lora.rank {config.rank} must be divisible by the router's top_k {top_k} with "
            "trainer.lora.normalize_moe_lora (expert rank = rank / top_k)"
        )
    return config.rank // top_k


def _named_leaf_parameters(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    return [
        (f"{module_name}.{leaf}" if module_name else leaf, module, leaf)
        for module_name, module in model.named_modules()
        for leaf, _ in module.named_parameters(recurse=False)
    ]


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable tensors (every LoRA A and B) by their module path: what a LoRA checkpoint holds."""
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def merged_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state with every adapted weight merged (W + scale * B @ A), under its plain name."""
    state = {name: tensor.detach() for name, tensor in model.state_dict().items() if ".parametrizations." not in name}
    with torch.no_grad():
        for module_name, module in model.named_modules():
            if parametrize.is_parametrized(module):
                for leaf in module.parametrizations:
                    state[f"{module_name}.{leaf}" if module_name else leaf] = getattr(module, leaf).detach()
    return state


def published(named_tensors: Iterator[tuple[str, torch.Tensor]], config: LoraConfig):
    """The (name, tensor) pairs a run publishes: all of them for full fine-tuning, the adapted layers for LoRA."""
    if not config.enabled:
        yield from named_tensors
        return
    for name, tensor in named_tensors:
        if is_published(name, config.target_modules):
            yield name, tensor


# -- adapter-only sync -----------------------------------------------------------------------------------------


def peft_names(hf_module: str) -> tuple[str, str]:
    """The PEFT (and vLLM) names of one module's A and B: ``base_model.model.<module>.lora_{A,B}.weight``."""
    return f"{PEFT_PREFIX}{hf_module}.lora_A.weight", f"{PEFT_PREFIX}{hf_module}.lora_B.weight"


def vllm_lora_b(lora_b: torch.Tensor, config: LoraConfig) -> torch.Tensor:
    """``lora_b`` [..., out, r] as vLLM applies it: vLLM scales every module by one ``alpha / rank``, an adapter of
    another rank (a routed expert's ``rank / top_k``) keeps its own ``alpha / r`` through the factor ``rank / r``."""
    factor = config.rank / lora_b.shape[-1]
    return lora_b if factor == 1 else lora_b * factor


def adapter_record(config: LoraConfig, expert_rank: int) -> LoraAdapter:
    """What a published adapter is (``WeightManifest.adapter``); ``expert_rank`` 0 when no expert is adapted."""
    modules = [name for target in config.target_modules for name in HF_MODULES[target]]
    return LoraAdapter(config.rank, float(config.alpha), modules, expert_rank)


def adapter_weights(model: nn.Module, config: LoraConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The torch backend's adapters in PEFT names (``adapter_record`` describes them), in module order.

    A fused expert tensor's adapter (transformers' ``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``)
    becomes one adapter per expert and projection, as vLLM's MoE LoRA loader expects: gate_proj and up_proj share
    the expert's A and take the first and second half of its B rows (the tensor's gate-then-up layout).
    """
    for module_name, module in model.named_modules():
        if not parametrize.is_parametrized(module):
            continue
        for leaf, parametrizations in module.parametrizations.items():
            delta = parametrizations[0]
            name = f"{module_name}.{leaf}" if module_name else leaf
            lora_a, lora_b = delta.lora_A.detach(), vllm_lora_b(delta.lora_B.detach(), config)
            yield from _per_module(name, lora_a, lora_b)


def _per_module(name: str, lora_a: torch.Tensor, lora_b: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    if name.endswith(".weight"):
        yield from zip(peft_names(name.removesuffix(".weight")), (lora_a, lora_b), strict=True)
    elif name.endswith(".experts.gate_up_proj"):
        prefix, rows = name.removesuffix("gate_up_proj"), lora_b.shape[1] // 2
        for expert, (a_RH, b_NR) in enumerate(zip(lora_a, lora_b, strict=True)):
            yield from zip(peft_names(f"{prefix}{expert}.gate_proj"), (a_RH, b_NR[:rows]), strict=True)
            yield from zip(peft_names(f"{prefix}{expert}.up_proj"), (a_RH, b_NR[rows:]), strict=True)
    elif name.endswith(".experts.down_proj"):
        prefix = name.removesuffix("down_proj")
        for expert, (a_RI, b_HR) in enumerate(zip(lora_a, lora_b, strict=True)):
            yield from zip(peft_names(f"{prefix}{expert}.down_proj"), (a_RI, b_HR), strict=True)
    else:
        raise ValueError(f"{name}: no PEFT module name for this adapted tensor (trainer.lora.sync='adapters')")


def expert_adapter_rank(model: nn.Module, config: LoraConfig) -> int:
    """The rank of the routed experts' adapters (torch backend); 0 when no expert weight is adapted."""
    adapted = (name for name, module in model.named_modules() if parametrize.is_parametrized(module))
    if not any(_ROUTED_EXPERTS.search(f"{name}.") for name in adapted):
        return 0
    return adapter_rank(config, ".mlp.experts.", getattr(model.config, "num_experts_per_tok", None))
