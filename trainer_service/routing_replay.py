"""Rollout Routing Replay (R3): train with the MoE experts the rollout engine actually chose.

vLLM returns, per sample, the top-k expert ids of every forwarded token in every MoE layer. Replaying them in
the trainer makes the trainer's forward use the same experts as the rollout, which removes the largest source of
trainer/inference mismatch in MoE RL. The router's gate weights are recomputed from the router's own (current)
logits at the forced experts, so the router keeps receiving gradients.

Shape legend: B samples, T tokens of the TrainBatch row (prompt + response, right-padded: ``input_ids_BT``'s
width), L MoE layers (model order), K experts per token (top-k).

``routes_BTLK`` (int64) holds expert ids; ``-1`` marks positions with no recorded route: the last token of each
row (vLLM never forwards the final sampled token) and padding. Those positions feed no trained log-prob (causal
attention; padding is key-masked), so they are routed naturally (torch) or to experts ``0..K-1`` (Megatron).

Three parts:
    routes_from_groups         Sample.routed_experts -> routes_BTLK aligned to build_batch's rows, or None
    record_routes / forced_routing                 transformers MoE models (top-k routers returning
                                                   ``(logits, scores, indices)``, e.g. Qwen3-MoE, Mixtral)
    megatron_record_routes / megatron_forced_routing   megatron-core GPTModel built with moe_enable_routing_replay,
                                                   in ``trainer_service.megatron.routing_replay``
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from protos.records import TrajectoryGroup

logger = logging.getLogger(__name__)

NO_ROUTE = -1


# -- (a) rollout routes -> one padded tensor ------------------------------------------------------------------


def routes_from_groups(groups: Sequence[TrajectoryGroup], width: int) -> torch.Tensor | None:
    """Stack the samples' routed experts into routes_BTLK, rows in ``build_batch`` order.

    Args:
        groups: The groups of one TrainBatch, in the order given to ``build_batch``.
        width: ``batch.input_ids_BT.shape[1]`` (T).

    Returns:
        int64 [B, T, L, K]; row b holds sample b's routes at positions ``0 .. n-1`` (n = prompt + response - 1,
        as vLLM returns them) and NO_ROUTE after. None when any sample carries no routes: replay is all-or-nothing
        per batch, so a batch is never trained with some rows forced and others not.

    Raises:
        ValueError: A sample's routes are longer than its token row, or layers/top-k differ between samples.
    """
    samples = [(group, sample) for group in groups for sample in group.samples]
    if not samples or any(sample.routed_experts is None for _, sample in samples):
        return None
    arrays = [sample.routed_experts.to_numpy() for _, sample in samples]
    layers_topk = {array.shape[1:] for array in arrays}
    if len(layers_topk) != 1 or any(array.ndim != 3 for array in arrays):
        raise ValueError(f"routed_experts must all be [tokens, layers, top_k] of one shape; got {layers_topk}")
    num_layers, top_k = layers_topk.pop()
    routes = torch.full((len(arrays), width, num_layers, top_k), NO_ROUTE, dtype=torch.long)
    for row, ((group, sample), array) in enumerate(zip(samples, arrays, strict=True)):
        num_tokens = len(group.prompt_token_ids.to_numpy()) + len(sample.response_token_ids.to_numpy())
        if len(array) > min(num_tokens, width):
            raise ValueError(
                f"group {group.group_id} sample {row}: {len(array)} routed positions for {num_tokens} tokens"
            )
        routes[row, : len(array)] = torch.from_numpy(array.astype(np.int64))
    return routes


# -- (b) transformers models ----------------------------------------------------------------------------------


def _is_sigmoid_router(router: torch.nn.Module) -> bool:
    """DeepSeek-V3 / Beam style: sigmoid scores + ``e_score_correction_bias``; returns (weights, ids, logits)."""
    return hasattr(router, "e_score_correction_bias") and hasattr(router, "routed_scaling_factor")


def _hf_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The top-k routers in module (= layer) order: softmax routers (``top_k``, ``num_experts``, ``weight``)
    and sigmoid routers with a correction bias (Beam's ``BeamRouter``)."""
    return [
        module
        for module in model.modules()
        if hasattr(module, "top_k")
        and (hasattr(module, "num_experts") or _is_sigmoid_router(module))
        and isinstance(getattr(module, "weight", None), torch.nn.Parameter)
    ]


def _decoder_layer_of(model: torch.nn.Module, router: torch.nn.Module) -> int:
    """The decoder layer a router sits in, from its module path (``model.layers.<i>.mlp.gate``)."""
    for name, module in model.named_modules():
        if module is router:
            parts = name.split(".")
            for part, following in itertools.pairwise(parts):
                if part == "layers" and following.isdigit():
                    return int(following)
    raise ValueError(f"router {type(router).__name__} is not inside a 'layers.<i>' module")


def _route_layer_indices(model: torch.nn.Module, routers: list[torch.nn.Module], num_route_layers: int) -> list[int]:
    """Which entry of the routes' layer axis each router replays.

    vLLM reports every decoder layer (dense ones too, e.g. Beam's first layers); recorded routes hold MoE layers
    only. Both are accepted: an axis as long as the router list is indexed in router order, one as long as the
    decoder by each router's own layer.
    """
    if num_route_layers == len(routers):
        return list(range(len(routers)))
    num_decoder_layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    if num_route_layers == num_decoder_layers:
        return [_decoder_layer_of(model, router) for router in routers]
    raise ValueError(
        f"routes have {num_route_layers} layers, the model has {len(routers)} MoE routers "
        f"in {num_decoder_layers} decoder layers"
    )


def _chosen_experts(router: torch.nn.Module, output: tuple) -> torch.Tensor:
    return output[1] if _is_sigmoid_router(router) else output[2]


def _merge_routes(forced_NK: torch.Tensor, natural_NK: torch.Tensor) -> torch.Tensor:
    """The forced experts, except where a token has no recorded route (NO_ROUTE): its natural ones there."""
    if forced_NK.shape != natural_NK.shape:
        raise ValueError(f"routes give {tuple(forced_NK.shape)} per layer, the router made {tuple(natural_NK.shape)}")
    forced_NK = forced_NK.to(natural_NK.device)
    missing_N = (forced_NK < 0).any(dim=-1, keepdim=True)
    return torch.where(missing_N, natural_NK, forced_NK)


def _forced_sigmoid_gate(router: torch.nn.Module, output: tuple, forced_NK: torch.Tensor) -> tuple:
    """Beam's router output ``(weights, ids, logits)`` with the forced experts; weights from its own logits.

    The same arithmetic as ``BeamRouter.forward`` after selection (sigmoid of the unbiased logits at the chosen
    experts, renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``): replaying the router's own
    choice is bit-exact, and the router weight still gets gradients through the logits.
    """
    weights_NK, natural_NK, logits_NE = output[0], output[1], output[2]
    ids_NK = _merge_routes(forced_NK, natural_NK)
    gate_NK = logits_NE.sigmoid().gather(-1, ids_NK)
    if router.norm_topk_prob:
        gate_NK = gate_NK / gate_NK.sum(dim=-1, keepdim=True)
    return (gate_NK * router.routed_scaling_factor).to(weights_NK.dtype), ids_NK, logits_NE


def _forced_gate(router: torch.nn.Module, output: tuple, forced_NK: torch.Tensor) -> tuple:
    """Replace a router's ``(logits, scores, indices)`` by the forced experts, gate weights from its own logits.

    The gate is the router's softmax at the forced experts, renormalised over the top-k when the router
    renormalises (``norm_topk_prob``; routers without the flag, e.g. Mixtral, always do). For the experts the
    router would pick anyway this is the same arithmetic as the router's own, so replaying natural routes is
    bit-exact.
    """
    logits_NE, scores_NK, natural_NK = output[0], output[1], output[2]
    indices_NK = _merge_routes(forced_NK, natural_NK)
    gate_NK = torch.softmax(logits_NE.float(), dim=-1).gather(1, indices_NK)
    if getattr(router, "norm_topk_prob", True):
        gate_NK = gate_NK / gate_NK.sum(dim=-1, keepdim=True)
    return (logits_NE, gate_NK.to(scores_NK.dtype), indices_NK, *output[3:])


@contextlib.contextmanager
def forced_routing(model: torch.nn.Module, routes_BTLK: torch.Tensor | None) -> Iterator[None]:
    """Make every forward inside the block use ``routes_BTLK`` (None: no replay, natural routing).

    The model's inputs must be ``[B, T]`` with the routes' B and T (routers see tokens flattened batch-major).
    """
    if routes_BTLK is None:
        yield
        return
    routers = _hf_routers(model)
    batch, seq, num_layers, top_k = routes_BTLK.shape
    handles = []
    for layer, router in zip(_route_layer_indices(model, routers, num_layers), routers, strict=True):
        forced_NK = routes_BTLK[:, :, layer].reshape(batch * seq, top_k)

        def hook(module, args, output, forced_NK=forced_NK):
            if _is_sigmoid_router(module):
                return _forced_sigmoid_gate(module, output, forced_NK)
            return _forced_gate(module, output, forced_NK)

        handles.append(router.register_forward_hook(hook))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class RouteRecorder:
    """Collects the experts each router chose; ``routes(batch, seq)`` stacks them as routes_BTLK."""

    def __init__(self) -> None:
        self.indices_NK: list[torch.Tensor | None] = []

    def routes(self, batch: int, seq: int) -> torch.Tensor:
        if not self.indices_NK or any(indices is None for indices in self.indices_NK):
            raise RuntimeError("no forward ran inside the recording block")
        layers = [indices.reshape(batch, seq, -1) for indices in self.indices_NK]
        return torch.stack(layers, dim=2).long().cpu()


@contextlib.contextmanager
def record_routes(model: torch.nn.Module) -> Iterator[RouteRecorder]:
    """Record the experts chosen during the (last) forward inside the block."""
    recorder = RouteRecorder()
    handles = []
    for layer, router in enumerate(_hf_routers(model)):
        recorder.indices_NK.append(None)

        def hook(module, args, output, layer=layer):
            recorder.indices_NK[layer] = _chosen_experts(module, output).detach()

        handles.append(router.register_forward_hook(hook))
    try:
        yield recorder
    finally:
        for handle in handles:
            handle.remove()
