"""Checkpoints of the Megatron backend: model chunks, megatron-core optimizer and RNG states, one file per rank.

Every rank calls ``save`` / ``load`` with the same directory (the multi-rank trainer: ``ranks.save_checkpoint``,
``ranks.resolve_checkpoint``); ``save`` returns on every rank once all ranks' files are written (a barrier), so
rank 0 may then publish the checkpoint and acknowledge the queue entries it covers.

Resuming from a checkpoint is bit-identical to continuing (tests/trainer_service/test_megatron_backend.py). The
layout (tensor/pipeline/expert/data parallel sizes) must be the same at load as at save: this is a per-rank
snapshot, not megatron-core's reshardable ``dist_checkpointing`` format, whose save path calls CUDA in 0.19.2 and
was not made to run on CPU here.

The experts' layout (``GroupedExperts`` or per-expert ``SequentialMLP``, ``trainer.megatron.moe_grouped_experts``)
must match too: their weights have other names and shapes, and a mismatch is refused naming the setting.

LoRA (a frozen base): the model part holds the adapters only. The base is what the backend loads from the HF
checkpoint at start and never changes, so a Beam-sized LoRA checkpoint is adapters + their Adam state, not the
whole model again.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from trainer_service.megatron import cpu_shims


def save(model: list, optimizer, directory: str | Path) -> None:
    """Write model chunks, optimizer (with the distributed optimizer's Adam shards) and RNG states, a file per rank;
    returns on every rank once all ranks' files are written (a barrier)."""
    import torch.distributed as dist

    write(snapshot(model, optimizer), directory)  # no reuse: the host copy is freed after the write
    dist.barrier()


def snapshot(model: list, optimizer, into: dict | None = None) -> dict:
    """What ``save`` writes, as it is now, copied to host memory (``write`` may then run on another thread while
    training goes on: one process, ``CheckpointWriter``); ``into``: an earlier snapshot whose host buffers are reused
    (its file written already)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from trainer_service.snapshots import copied

    rng = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    adapters_only = _has_frozen_base(model)
    stepped = has_stepped(optimizer)
    with cpu_shims.cuda_tensors_on_cpu():
        return copied(
            {
                "model": [_model_state(chunk, adapters_only) for chunk in model],
                "adapters_only": adapters_only,
                "experts_layout": experts_layout(model),
                # None before the first optimizer step: the state is the one a new optimizer has, and megatron's
                # distributed optimizer cannot write it (``state_dict`` asserts one shared Adam step count, of which
                # there is none yet: issue 26, a trainer whose every group was stale checkpointed so)
                "optimizer": optimizer.state_dict() if stepped else None,
                "optimizer_params": [_param_state(sub) for sub in sub_optimizers(optimizer)] if stepped else None,
                "rng": rng,
            },
            into,
        )


def write(state: dict, directory: str | Path) -> None:
    """This rank's file of a ``snapshot`` (no collective: safe on a thread of its own)."""
    import torch.distributed as dist

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    torch.save(state, path / f"rank{dist.get_rank():05d}.pt")


def load(model: list, optimizer, directory: str | Path) -> None:
    """Restore what ``save`` wrote into a model and optimizer built with the same parallel layout."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = torch.load(Path(directory) / f"rank{dist.get_rank():05d}.pt", weights_only=False)
    if state.get("adapters_only", False) != _has_frozen_base(model):
        raise ValueError(
            f"{directory}: checkpoint written with{'' if state.get('adapters_only') else 'out'} LoRA; "
            "trainer.lora.rank must match the run that wrote it"
        )
    saved_layout, layout = state.get("experts_layout"), experts_layout(model)
    if saved_layout and layout and saved_layout != layout:
        raise ValueError(
            f"{directory}: checkpoint written with {saved_layout} experts, this model has {layout} experts; "
            "trainer.megatron.moe_grouped_experts (and moe_grouped_lora) must match the run that wrote it"
        )
    for chunk, chunk_state in zip(model, state["model"], strict=True):
        _load_model_state(chunk, _adapter_wrapper_keys(chunk, chunk_state), state.get("adapters_only", False))
    if state["optimizer"] is not None:  # None: saved before the first step, the optimizer stays as built
        _load_optimizer(optimizer, state)
    rng = state["rng"]
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None:
        torch.cuda.set_rng_state_all(rng["cuda"])
    get_cuda_rng_tracker().set_states(rng["tracker"])


def _load_optimizer(optimizer, state: dict) -> None:
    # no_grad: the state is copied into views of the parameters.
    with torch.no_grad(), cpu_shims.cuda_tensors_on_cpu():
        optimizer.load_state_dict(state["optimizer"])
        for sub, param_state in zip(sub_optimizers(optimizer), state["optimizer_params"], strict=True):
            _unshare_step_counters(sub)
            if param_state is not None:
                sub.load_parameter_state_from_dp_reshardable(param_state)


def has_stepped(optimizer) -> bool:
    """Whether any of the chained optimizers took a step (its inner torch optimizer holds per-parameter state)."""
    return any(len(getattr(sub, "optimizer", sub).state) > 0 for sub in sub_optimizers(optimizer))


def experts_layout(model: list) -> str | None:
    """How the model's MoE experts hold their weights: "grouped", "sequential" (per expert), None without MoE."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from trainer_service.megatron.grouped_experts import GroupedExperts

    for module in (module for chunk in model for module in chunk.modules()):
        if isinstance(module, GroupedExperts):
            return "grouped"
        if isinstance(module, SequentialMLP):
            return "sequential"
    return None


def _has_frozen_base(model: list) -> bool:
    return any(not p.requires_grad for chunk in model for p in chunk.parameters())


def _model_state(chunk, adapters_only: bool) -> dict:
    """What a checkpoint keeps of a model chunk: everything, or under LoRA the adapter tensors alone."""
    state = chunk.state_dict()
    return {key: value for key, value in state.items() if ".adapter." in key} if adapters_only else state


def _load_model_state(chunk, chunk_state: dict, adapters_only: bool) -> None:
    if not adapters_only:
        chunk.load_state_dict(chunk_state)
        return
    module = getattr(chunk, "module", chunk)  # megatron's DDP wrapper returns nothing from load_state_dict
    current = module.state_dict()
    resized = [
        key
        for key, value in chunk_state.items()
        if key in current and getattr(value, "shape", None) != getattr(current[key], "shape", None)
    ]
    if resized:
        raise ValueError(
            f"LoRA checkpoint does not fit this model: {resized[0]} has shape "
            f"{tuple(chunk_state[resized[0]].shape)}, here {tuple(current[resized[0]].shape)} "
            "(trainer.lora.rank must match the run that wrote it)"
        )
    missing, unexpected = module.load_state_dict(chunk_state, strict=False)
    missing_adapters = [key for key in missing if ".adapter." in key]
    if unexpected or missing_adapters:
        raise ValueError(
            f"LoRA checkpoint does not fit this model (trainer.lora rank / target_modules): unexpected "
            f"{unexpected[:3]}, missing adapters {missing_adapters[:3]}"
        )


def _adapter_wrapper_keys(chunk, chunk_state: dict) -> dict:
    """LoRA's ``AdapterWrapper`` writes its wrapped linear under its own prefix (``state_dict`` flattens
    ``to_wrap``) but ``load_state_dict`` looks for it under ``<prefix>to_wrap.``: rename those keys back."""
    from megatron.bridge.peft.adapter_wrapper import AdapterWrapper  # imported with the bridge (cpu_shims)

    module = getattr(chunk, "module", chunk)  # DDP-wrapped chunk; its state_dict keys have no "module."
    wrapped = [name + "." for name, sub in module.named_modules() if isinstance(sub, AdapterWrapper)]
    if not wrapped:
        return chunk_state
    renamed = {}
    for key, value in chunk_state.items():
        prefix = next((p for p in wrapped if key.startswith(p) and not key.startswith(p + "adapter.")), None)
        renamed[f"{prefix}to_wrap.{key[len(prefix) :]}" if prefix else key] = value
    return renamed


def sub_optimizers(optimizer) -> list:
    """megatron-core chains one optimizer per parameter class (dense, expert)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _unshare_step_counters(optimizer) -> None:
    """Give each parameter its own AdamW ``step`` tensor again.

    megatron-core's ``load_state_dict`` (torch-optimizer path, no TE/apex) puts one shared ``step`` tensor into
    every parameter's state; torch AdamW then increments it once per parameter per step, which corrupts the bias
    correction of every later step.
    """
    inner = getattr(optimizer, "optimizer", None)
    if inner is None:
        return
    for param_state in inner.state.values():
        if isinstance(param_state.get("step"), torch.Tensor):
            param_state["step"] = param_state["step"].clone()


def _param_state(optimizer) -> dict | None:
    """This rank's shard of a distributed optimizer's main params and Adam moments (None: in state_dict()).

    The "dp_reshardable" form holds every optimizer state tensor (torch AdamW's per-parameter ``step`` too, which
    the dp_zero form of ``save_parameter_state`` omits and its loader then requires). Tensors are cloned: they are
    views into the flat buffers, and saving a view would write the whole buffer once per parameter.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if not isinstance(optimizer, DistributedOptimizer):
        return None

    def detach(value):
        if isinstance(value, torch.Tensor):
            return value.detach().clone()
        if isinstance(value, dict):
            # The loader skips entries marked as padding; real entries need the flag.
            entry = {key: detach(item) for key, item in value.items()}
            if "gbuf_local_start" in value:
                entry.setdefault("padding", False)
            return entry
        if isinstance(value, list):
            return [detach(item) for item in value]
        return value

    return detach(optimizer.get_parameter_state_dp_reshardable())
