"""Routing for vLLM's layerwise reload: the tensors a model's own loader writes past its parameters' weight loaders are
sent through those loaders instead (runs inside the vLLM worker).

Why: ``reload_weights(..., is_checkpoint_format=True)`` moves every layer's parameters to the meta device, wraps each
parameter's ``weight_loader`` to buffer the layer's loads, and rebuilds and copies a layer back into the served memory
only once its loaders have received all of its elements. A write that skips ``weight_loader`` lands on a meta tensor
and is dropped; a layer that received nothing gets its old tensors back ("<Layer>: Failed to load weights").

vLLM 0.32's gpt-oss loader (``GptOssModel._load_weights_other``) writes the fused experts (``w13``/``w2`` weights and
biases) and the attention sinks with plain ``param.copy_``: a weight update leaves them at the old values, and on CPU
the old, already prepacked experts are then prepacked a second time. Routed here instead:

- fused experts are split into vLLM's own per-expert names (``...mlp.experts.<e>.w13_weight``), which its gpt-oss
  loader sends through the experts' ``weight_loader`` with the same rank slicing and transpose as the fused path;
- sinks go through the sinks parameter's (wrapped) ``weight_loader`` with the fused path's head slice.

Only used on a reload: a fresh load writes into real tensors, where the plain copies take.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

# vLLM's names (after the model's checkpoint-name mapper) of gpt-oss's fused expert tensors: [experts, ...] each.
_FUSED_EXPERT_LEAVES = ("w13_weight", "w2_weight", "w13_bias", "w2_bias")


def route_reload_weights(
    model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
) -> Iterable[tuple[str, torch.Tensor]]:
    """``weights`` for vLLM's layerwise reload of ``model``: as they are, unless ``model``'s loader bypasses weight
    loaders (gpt-oss); then an iterator that routes those tensors through them. Consume it inside ``reload_weights``."""
    from vllm.model_executor.models.gpt_oss import GptOssForCausalLM

    if not isinstance(model, GptOssForCausalLM):
        return weights
    return _route_gpt_oss(model, weights)


def _route_gpt_oss(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator:
    # Quantized checkpoints (mxfp4, quark) take other loader paths, whose experts already use weight loaders.
    split_experts = model.vllm_config.model_config.quantization is None
    for name, tensor in weights:
        vllm_name = model.hf_to_vllm_mapper.map_name(name)
        if vllm_name is None:
            yield name, tensor
        elif vllm_name.endswith(".sinks"):
            _load_sinks(model, vllm_name, tensor)
            # vLLM's loader still gets the tensor so that it counts it as loaded; its own copy_ then goes to the meta
            # stand-in it looked up before the layer was put back (or would write the same values).
            yield name, tensor
        elif split_experts and _is_fused_expert(vllm_name):
            prefix, _, leaf = vllm_name.rpartition(".")
            for expert in range(tensor.shape[0]):
                yield f"{prefix}.{expert}.{leaf}", tensor[expert]
        else:
            yield name, tensor


def _is_fused_expert(vllm_name: str) -> bool:
    prefix, _, leaf = vllm_name.rpartition(".")
    return leaf in _FUSED_EXPERT_LEAVES and prefix.endswith(".mlp.experts")


def _load_sinks(model: torch.nn.Module, vllm_name: str, tensor: torch.Tensor) -> None:
    """Load one layer's sinks through the parameter's weight loader, sliced to this rank's heads as vLLM's gpt-oss
    loader slices them (``num_attention_heads // tp_size`` heads from ``tp_rank`` on)."""
    from vllm.distributed import get_tensor_model_parallel_rank
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    module_name, _, leaf = vllm_name.rpartition(".")
    try:
        param = model.get_submodule(module_name).get_parameter(leaf)
    except AttributeError:  # a layer of another pipeline stage (vLLM's PPMissingLayer): its loader skips it too
        return
    heads_per_rank = param.shape[0]
    narrowed = tensor.narrow(0, get_tensor_model_parallel_rank() * heads_per_rank, heads_per_rank)
    getattr(param, "weight_loader", default_weight_loader)(param, narrowed)
