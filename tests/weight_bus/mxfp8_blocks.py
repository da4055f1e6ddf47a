"""Block builders and byte views shared by the MXFP8 codec tests (test_mxfp8*.py)."""

from __future__ import annotations

import torch

from weight_bus.codecs.mxfp8 import quantize_reference


def element_bytes(t: torch.Tensor) -> torch.Tensor:
    """E4M3 elements as their bytes (uint8 views compare exactly, NaN included); other tensors as they are."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def block(values, fill: float = 0.0, dtype=torch.float32) -> torch.Tensor:
    """One 32-element block [1, 32] starting with ``values``."""
    t = torch.full((1, 32), fill, dtype=torch.float64)
    t[0, : len(values)] = torch.tensor(values, dtype=torch.float64)
    return t.to(dtype)


def scale_byte(values, rule="rceil", dtype=torch.float32) -> int:
    """The reference encoder's E8M0 scale byte of one block starting with ``values``."""
    return int(quantize_reference(block(values, dtype=dtype), rule)[1].item())
