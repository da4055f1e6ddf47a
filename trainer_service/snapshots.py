"""Checkpoint snapshots: a backend's state copied off the tensors that training changes, so that its files can be
written on another thread while the next step trains (``CheckpointWriter``).

The copy costs host memory the size of the checkpoint and a device-to-host copy (a GPU's memory bandwidth, seconds
for a 15 GB state); the write it moves off the step is the disk's bandwidth (the 0.94 B model's checkpoints made its
step ~20 s slower, issue 26).
"""

from __future__ import annotations

import torch


def copied(value, into=None):
    """``value`` with every tensor inside (dicts, lists, tuples) copied to host memory; other leaves as they are.

    ``into``: an earlier copy of the same structure, whose host tensors are reused where shape and dtype match (a
    fresh allocation is touched page by page: about 1 GB/s on the CI machine, against 5 GB/s into touched memory).
    Its files must be written already: its tensors are overwritten.
    """
    if isinstance(value, torch.Tensor):
        if isinstance(into, torch.Tensor) and into.shape == value.shape and into.dtype == value.dtype:
            return into.copy_(value.detach())
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        into = into if isinstance(into, dict) else {}
        return {key: copied(item, into.get(key)) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        into = into if isinstance(into, type(value)) and len(into) == len(value) else [None] * len(value)
        items = [copied(item, previous) for item, previous in zip(value, into, strict=True)]
        return items if isinstance(value, list) else tuple(items)
    return value


def model_tensors(model: torch.nn.Module, into=None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """What ``safetensors.torch.save_model`` writes of ``model``, copied: its state dict less the names that share a
    tensor (tied embeddings), and the metadata naming each dropped one's kept name (``load_model`` expects both).
    ``_remove_duplicate_names`` is the rule ``save_model`` and ``load_model`` themselves apply."""
    from safetensors.torch import _remove_duplicate_names

    state = model.state_dict()
    metadata: dict[str, str] = {}
    for kept, dropped in _remove_duplicate_names(state).items():
        for name in dropped:
            metadata[name] = kept
            del state[name]
    into = into or {}
    return {name: copied(tensor.contiguous(), into.get(name)) for name, tensor in state.items()}, metadata
