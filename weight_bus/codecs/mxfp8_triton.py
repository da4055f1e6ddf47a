"""The Triton MXFP8 encoder (CUDA sm_89+): one program per ``groups`` x 32 elements.

Bit-identical to ``mxfp8.quantize_reference`` (``benchmarks/mxfp8_codec.py --check`` on a GPU); the rules and the
layout are in ``mxfp8``'s docstring. The kernel is built on first use, so that CPU-only imports never load triton.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

BLOCK_SIZE = 32  # mxfp8.BLOCK_SIZE: elements per E8M0 scale


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # pragma: no cover - depends on the environment
        return False
    return True


@functools.lru_cache(maxsize=1)
def _triton_kernel():
    """Build the Triton kernel lazily (keeps CPU-only imports free of triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _mxfp8_quantize_kernel(
        x_ptr,
        q_ptr,
        s_ptr,
        n_groups,
        FLOOR: tl.constexpr,
        GROUPS: tl.constexpr,
        EVEN: tl.constexpr,
        EVICT_FIRST: tl.constexpr,
    ):
        pid = tl.program_id(0)
        # 64-bit program base so tensors > 2**31 elements index correctly.
        g0 = pid.to(tl.int64) * GROUPS
        x_base = x_ptr + g0 * 32
        q_base = q_ptr + g0 * 32
        s_base = s_ptr + g0
        rows = tl.arange(0, GROUPS)
        offs = rows[:, None] * 32 + tl.arange(0, 32)[None, :]
        if EVEN:
            if EVICT_FIRST:
                x = tl.load(x_base + offs, eviction_policy="evict_first")
            else:
                x = tl.load(x_base + offs)
        else:
            rmask = (g0 + rows) < n_groups
            x = tl.load(x_base + offs, mask=rmask[:, None], other=0.0)
        xf = x.to(tl.float32)
        abs_bits = xf.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        amax_bits = tl.max(abs_bits, axis=1)
        biased_exp = amax_bits >> 23
        if FLOOR:
            scale_i = biased_exp - 8
        else:
            scale_i = biased_exp - 8 + ((amax_bits & 0x7FFFFF) > 0x600000).to(tl.int32)
        scale_i = tl.minimum(tl.maximum(scale_i, 0), 254)
        mult = ((254 - scale_i) << 23).to(tl.float32, bitcast=True)
        y = xf * mult[:, None]
        if FLOOR:
            y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        qb = y.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
        nonfinite = amax_bits >= 0x7F800000
        qb = tl.where(nonfinite[:, None], 0x7F, qb).to(tl.uint8)
        sb = tl.where(nonfinite, 255, scale_i).to(tl.uint8)
        if EVEN:
            tl.store(q_base + offs, qb)
            tl.store(s_base + rows, sb)
        else:
            tl.store(q_base + offs, qb, mask=rmask[:, None])
            tl.store(s_base + rows, sb, mask=rmask)

    return _mxfp8_quantize_kernel


# Tuned on an H200 (see docs/benchmarks-mxfp8.md and benchmarks/mxfp8_codec.py --sweep).
DEFAULT_TRITON_CONFIG: dict[str, Any] = {"groups": 128, "num_warps": 4, "evict_first": False}


def quantize_triton(
    x: torch.Tensor,
    rule: str,
    *,
    groups: int | None = None,
    num_warps: int | None = None,
    evict_first: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton MXFP8 encoder. ``x`` must already be validated (``mxfp8._prepare_input``); ``groups``,
    ``num_warps``, ``evict_first`` default to ``DEFAULT_TRITON_CONFIG``."""
    import triton

    cfg = DEFAULT_TRITON_CONFIG
    groups = cfg["groups"] if groups is None else groups
    num_warps = cfg["num_warps"] if num_warps is None else num_warps
    evict_first = cfg["evict_first"] if evict_first is None else evict_first

    x = x.contiguous()
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((*x.shape[:-1], x.shape[-1] // BLOCK_SIZE), dtype=torch.uint8, device=x.device)
    n_groups = x.numel() // BLOCK_SIZE
    if n_groups == 0:
        return q, scale
    kernel = _triton_kernel()
    grid = (triton.cdiv(n_groups, groups),)
    kernel[grid](
        x,
        q.view(torch.uint8),
        scale,
        n_groups,
        FLOOR=(rule == "floor"),
        GROUPS=groups,
        EVEN=(n_groups % groups == 0),
        EVICT_FIRST=evict_first,
        num_warps=num_warps,
    )
    return q, scale
