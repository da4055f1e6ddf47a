"""Checkpoint snapshots: a backend's state copied off the tensors that training changes, so that its files can be
written on another thread while the next step trains (``CheckpointWriter``).

The copy costs host memory the size of the checkpoint and a device-to-host copy (a GPU's memory bandwidth, seconds
for a 15 GB state); the write it moves off the step is the disk's bandwidth (the 0.94 B model's checkpoints made its
step ~20 s slower, issue 26).
"""

from __future__ import annotations

import torch


def copied(value):
    """``value`` with every tensor inside (dicts, lists, tuples) copied to host memory; other leaves as they are."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: copied(item) for key, item in value.items()}
    if isinstance(value, list):
        return [copied(item) for item in value]
    if isinstance(value, tuple):
        return tuple(copied(item) for item in value)
    return value


def model_tensors(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
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
    return {name: copied(tensor).contiguous() for name, tensor in state.items()}, metadata
