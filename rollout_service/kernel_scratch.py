"""Kernel scratch tensors kept across weight reloads (runs in the vLLM worker).

Marlin kernels (vLLM's weight-only MXFP8, FP8, GPTQ and AWQ GEMMs on Hopper and Ampere) keep a ``workspace`` tensor
on each layer: an int32 array of locks the kernel's thread blocks spin on, zero whenever no kernel runs (each kernel
leaves it as it found it). ``process_weights_after_loading`` allocates a new one on every reload, and vLLM's
layerwise reload copies the new values of parameters and buffers back into the tensors the CUDA graphs captured, but
not plain attributes. So after an update the graphs still read the old workspace's address while the old tensor is
freed and its memory handed to the next allocation: a graph replay then spins on whatever was written there. An
engine serving online MXFP8 hung this way on its first or a later update (issue 25: "received v2 and never
committed"; 2026-12-07 on an H100: committed v1, then no request of the next step ever finished).

``kept_across_reload`` holds every layer's workspace through the reload and puts it back on the layer afterwards,
zeroed, when the new one is a fresh lock array (int32, all zero) of its shape and device: the graphs, the layer and
the kernels then use one memory again. A workspace that changed shape is left as vLLM made it, with a warning (the
captured graphs would need capturing again); one that is not a fresh lock array (another kernel's state) too.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch

log = logging.getLogger(__name__)

SCRATCH_ATTRIBUTES = ("workspace",)


def scratch_tensors(model: torch.nn.Module) -> dict[tuple[torch.nn.Module, str], torch.Tensor]:
    """Every (layer, attribute) whose value is a plain tensor attribute named in SCRATCH_ATTRIBUTES."""
    found = {}
    for module in model.modules():
        for name in SCRATCH_ATTRIBUTES:
            value = module.__dict__.get(name)  # plain attributes only: parameters and buffers live elsewhere
            if isinstance(value, torch.Tensor):
                found[(module, name)] = value
    return found


def restore_scratch(kept: dict[tuple[torch.nn.Module, str], torch.Tensor]) -> tuple[int, list[str]]:
    """Put each kept tensor back where a reload replaced it with one of the same shape, dtype and device (zeroed
    first); returns how many were put back and the layers whose new scratch differs (left as they are)."""
    restored, differing = 0, []
    for (module, name), old in kept.items():
        new = module.__dict__.get(name)
        if new is old:
            continue
        if not isinstance(new, torch.Tensor) or (new.shape, new.dtype, new.device) != (
            old.shape,
            old.dtype,
            old.device,
        ):
            differing.append(f"{type(module).__name__}.{name}")
            continue
        if new.dtype != torch.int32 or bool(new.any()):  # not a fresh lock array (another kernel's state): leave it
            continue
        with torch.no_grad():
            old.zero_()  # what a fresh workspace holds; no kernel runs while the engine is paused for the load
        setattr(module, name, old)
        restored += 1
    return restored, differing


@contextmanager
def kept_across_reload(model: torch.nn.Module) -> Iterator[None]:
    """Hold the model's kernel scratch tensors through a reload and put them back after it (module docstring)."""
    kept = scratch_tensors(model)
    yield
    if not kept:
        return
    restored, differing = restore_scratch(kept)
    if differing:
        log.warning(
            "kernel scratch changed shape in a reload (%s): CUDA graphs captured before it may read freed memory",
            ", ".join(sorted(set(differing))[:4]),
        )
    log.debug("kernel scratch kept across the reload: %d tensors", restored)
