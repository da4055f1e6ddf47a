"""The MXFP8 fast path is bit-identical to the reference on the CPU: torch.compile (marked ``slow``) and the
Triton kernel's logic through the Triton interpreter (weight_bus.codecs.mxfp8_triton). The CUDA Triton kernel is
checked bit-for-bit by ``benchmarks/mxfp8_codec.py --check`` on a GPU.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.weight_bus.mxfp8_blocks import element_bytes
from weight_bus.codecs import mxfp8
from weight_bus.codecs.mxfp8 import quantize_kernel, quantize_reference

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------
# fast path == reference (CPU)
# ------------------------------------------------------------------------------------------


def _stress_tensor(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.randint(-150, 126, (48, 8, 1), generator=g).double())
    x = (torch.randn(48, 8, 32, generator=g, dtype=torch.float64) * mag).float().reshape(48, 256)
    x[0, :32] = 0.0
    x[1, :32] = -0.0
    x[2, 3] = 448.0
    x[3, 3] = torch.tensor(448.0).nextafter(torch.tensor(1e9)).item()
    x[4, 5] = math.nan
    x[5, 40] = -math.inf
    x[6, :] = 1e-40
    return x


@pytest.mark.slow  # torch.compile on 2 CPU cores: ~25 s cold, ~5 s with a warm inductor cache
def test_torch_compile_kernel_is_bit_identical_to_reference_on_cpu():
    x = _stress_tensor()
    for dtype in (torch.float32, torch.bfloat16):
        for rule in mxfp8.RULES:
            q, s = quantize_kernel(x.to(dtype), rule)
            qr, sr = quantize_reference(x.to(dtype), rule)
            assert torch.equal(element_bytes(q), element_bytes(qr)), (dtype, rule)
            assert torch.equal(s, sr), (dtype, rule)


_INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import math, torch
    from weight_bus.codecs import mxfp8 as m
    from weight_bus.codecs.mxfp8_triton import quantize_triton
    g = torch.Generator().manual_seed(0)
    # values exactly representable after scaling (E4M3 values times a per-block power of two):
    # every correct encoder agrees bit-for-bit on these, whatever its rounding
    base = torch.randn(40, 256, generator=g).to(torch.float8_e4m3fn).float()
    k = torch.randint(-20, 20, (40, 8, 1), generator=g).float()
    x = (base.reshape(40, 8, 32) * torch.exp2(k)).reshape(40, 256)
    x[0, :32] = 0.0; x[1, :32] = -0.0; x[2, 5] = math.inf; x[3, 40] = math.nan
    bad = 0
    for dtype in (torch.float32, torch.bfloat16):
        for rule in m.RULES:
            for cols, groups in ((256, 16), (224, 16), (256, 8)):  # even and ragged grids
                xx = x[:, :cols].to(dtype).contiguous()
                q, s = quantize_triton(xx, rule, groups=groups)
                qr, sr = m.quantize_reference(xx, rule)
                bad += int(not torch.equal(q.view(torch.uint8), qr.view(torch.uint8)))
                bad += int(not torch.equal(s, sr))
            # random data: scale bytes must agree (the interpreter's fp8 cast is not RNE)
            xr = torch.randn(40, 256, generator=g).to(dtype) * 1e3
            bad += int(not torch.equal(quantize_triton(xr, rule, groups=16)[1], m.quantize_reference(xr, rule)[1]))
    print("BAD", bad)
    """
)


def test_triton_kernel_logic_matches_reference_in_triton_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO_ROOT))
    out = subprocess.run(
        [sys.executable, "-c", _INTERPRETER_SCRIPT], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "BAD 0" in out.stdout, out.stdout + out.stderr[-3000:]
