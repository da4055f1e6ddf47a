"""Rollout Routing Replay (R3) on megatron-core: replay or record the experts through its ``RouterReplay``.

The model must be built with ``moe_enable_routing_replay`` (``megatron.routing_replay``). Shapes and the meaning of
``routes_BTLK`` (``-1``: no recorded route): ``trainer_service.routing_replay``. Positions without a route are
routed to experts ``0..K-1``; they feed no trained log-prob.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch


def _megatron_replays(model_chunks: Sequence[torch.nn.Module]) -> list:
    """Each MoE router's ``RouterReplay`` in layer order (the model's own, not RouterReplay's global list, which
    also holds the routers of every other model built in this process)."""
    from megatron.core.transformer.moe.router import TopKRouter

    replays = []
    for chunk in model_chunks:
        for module in chunk.modules():
            if isinstance(module, TopKRouter):
                if module.router_replay is None:
                    raise ValueError("the model was built without moe_enable_routing_replay (megatron.routing_replay)")
                replays.append(module.router_replay)
    return sorted(replays, key=lambda replay: replay.layer_number)


def _moe_layer_numbers(model_chunks: Sequence[torch.nn.Module]) -> list[int]:
    """megatron's global (1-based) numbers of the model's MoE layers, over every pipeline stage."""
    from megatron.core.utils import get_model_config

    config = get_model_config(model_chunks[0])
    freq = config.moe_layer_freq
    pattern = [int(i % freq == 0) for i in range(config.num_layers)] if isinstance(freq, int) else list(freq)
    return [number for number, is_moe in enumerate(pattern, start=1) if is_moe]


def _layer_index(replay, num_route_layers: int, num_model_layers: int, moe_layer_numbers: list[int]) -> int:
    # With every layer MoE (Qwen3-MoE) the route axis is the decoder layer; otherwise it counts MoE layers. Both
    # are global: a pipeline stage holds only some layers, and its routers carry their global layer numbers.
    if num_route_layers == num_model_layers:
        return replay.layer_number - 1
    return moe_layer_numbers.index(replay.layer_number)


@contextlib.contextmanager
def megatron_forced_routing(
    model_chunks: Sequence[torch.nn.Module],
    routes_BTLK: torch.Tensor | None,
    num_model_layers: int | None = None,
    keep_for_recompute: bool = False,
) -> Iterator[None]:
    """Replay ``routes_BTLK`` in every forward inside the block through megatron-core's ``RouterReplay``.

    ``num_model_layers`` (the decoder's layer count) lets a route axis that spans every decoder layer be indexed by
    each router's global layer number; otherwise the routes' layer axis counts the model's MoE layers (all pipeline
    stages, from ``moe_layer_freq``), and each stage's routers take their own entries.

    Megatron's routers see tokens sequence-major (``[T, B]`` flattened), so the routes are transposed. Positions
    without a route get experts ``0..K-1``: they feed no trained log-prob (``trainer_service.routing_replay``).

    ``keep_for_recompute``: activation recompute re-runs the routers in the backward, after the block has closed.
    Each forward also queues its routes on the router (``RouterReplay``'s backward list); on leaving, the routers
    are switched to popping that queue, first in first out over micro-batches, as pipeline schedules run their
    backwards in forward order. ``megatron_clear_routing_replay`` ends it once the step's backwards are done.
    """
    if routes_BTLK is None:
        yield
        return
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replays = _megatron_replays(model_chunks)
    moe_layer_numbers = _moe_layer_numbers(model_chunks)
    batch, seq, num_layers, top_k = routes_BTLK.shape
    if num_layers not in (len(moe_layer_numbers), num_model_layers):
        raise ValueError(f"routes have {num_layers} layers, the model has {len(moe_layer_numbers)} MoE routers")
    fill_K = torch.arange(top_k, dtype=torch.long, device=routes_BTLK.device)
    for replay in replays:
        layer = _layer_index(replay, num_layers, num_model_layers or len(moe_layer_numbers), moe_layer_numbers)
        indices_NK = routes_BTLK[:, :, layer].transpose(0, 1).reshape(seq * batch, top_k).long()
        missing_N = (indices_NK < 0).any(dim=-1, keepdim=True)
        indices_NK = torch.where(missing_N, fill_K.expand_as(indices_NK), indices_NK)
        if not keep_for_recompute:  # else earlier micro-batches' queued routes wait for their backwards
            replay.clear_indices()
        replay.set_target_indices(indices_NK)
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        for replay in replays:
            if keep_for_recompute:
                replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
            else:
                replay.clear_router_replay_action()
                replay.clear_indices()


def megatron_clear_routing_replay(model_chunks: Sequence[torch.nn.Module]) -> None:
    """Back to natural routing with nothing queued (after a step whose recompute replayed routes)."""
    for chunk in model_chunks:
        for module in chunk.modules():
            replay = getattr(module, "router_replay", None)
            if replay is not None:
                replay.clear_router_replay_action()
                replay.clear_indices()


class MegatronRouteRecorder:
    """Reads the routes megatron's ``RouterReplay`` recorded; ``routes(batch, seq)`` gives routes_BTLK."""

    def __init__(self, replays: list) -> None:
        self.replays = replays

    def routes(self, batch: int, seq: int) -> torch.Tensor:
        layers = []
        for replay in self.replays:
            indices_NK = replay.get_recorded_indices()
            if indices_NK is None:
                raise RuntimeError("no forward ran inside the recording block")
            layers.append(indices_NK.reshape(seq, batch, -1).transpose(0, 1))
        return torch.stack(layers, dim=2).long().cpu()


@contextlib.contextmanager
def megatron_record_routes(model_chunks: Sequence[torch.nn.Module]) -> Iterator[MegatronRouteRecorder]:
    """Record the experts chosen during the (last) forward inside the block."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replays = _megatron_replays(model_chunks)
    for replay in replays:
        replay.clear_indices()
        replay.set_router_replay_action(RouterReplayAction.RECORD)
    try:
        yield MegatronRouteRecorder(replays)
    finally:
        for replay in replays:
            replay.clear_router_replay_action()
