"""Pinned host staging of a version's device tensors before they are packed (the LoRA adapter sync).

The trainer's adapters live on its GPU; the tcp publisher packs host bytes. ``PinnedHostStaging.stage`` copies
every device tensor into one page-locked host buffer with asynchronous copies (one synchronize for all of them,
instead of a blocking ``.cpu()`` per tensor into pageable memory) and hands on views of it, which packing reads
directly. The buffer is kept and reused from version to version (the adapters' sizes do not change), growing only
when a version needs more. Host tensors pass through untouched, so on a CPU machine staging is a no-op.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

ALIGN_BYTES = 64  # each tensor's view starts aligned for any dtype


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def on_device(tensor: torch.Tensor) -> bool:
    return tensor.device.type != "cpu"


def staging_nbytes(named_tensors: Iterable[tuple[str, torch.Tensor]], staged=on_device) -> int:
    """Bytes of host buffer the tensors to stage (``staged``: the device ones) take, each aligned."""
    return sum(_aligned(t.numel() * t.element_size()) for _, t in named_tensors if staged(t))


def copy_into(
    buffer: torch.Tensor, named_tensors: list[tuple[str, torch.Tensor]], non_blocking: bool, staged=on_device
) -> list[tuple[str, torch.Tensor]]:
    """Copy every tensor to stage (``staged``: the device ones) into consecutive aligned views of ``buffer``
    (uint8); the others pass through."""
    views, offset = [], 0
    for name, tensor in named_tensors:
        if not staged(tensor):
            views.append((name, tensor))
            continue
        nbytes = tensor.numel() * tensor.element_size()
        view = buffer[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor, non_blocking=non_blocking)
        views.append((name, view))
        offset += _aligned(nbytes)
    return views


def host_array(nbytes: int, pinned: bool) -> np.ndarray:
    """A uint8 host array, page-locked when ``pinned`` (device-to-host copies into it are asynchronous).

    The array's base is the torch tensor that owns the memory, so the memory lives as long as the array.
    """
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned).numpy()


class PinnedHostStaging:
    """One reused page-locked host buffer that device tensors are staged through (see the module docstring)."""

    def __init__(self):
        self.buffer: torch.Tensor | None = None

    def stage(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """The tensors as host tensors: device ones copied into the pinned buffer (valid until the next call)."""
        named = list(named_tensors)
        nbytes = staging_nbytes(named)
        if nbytes == 0:
            return named
        if self.buffer is None or self.buffer.numel() < nbytes:
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        staged = copy_into(self.buffer, named, non_blocking=True)
        torch.cuda.synchronize()  # every copy has landed before packing reads the views
        return staged
