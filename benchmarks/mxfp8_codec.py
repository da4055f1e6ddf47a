#!/usr/bin/env python
"""MXFP8 codec on a CUDA GPU: bit-exactness check and bandwidth benchmark.

Run from the repository root (only torch and triton are imported)::

    PYTHONPATH=. python benchmarks/mxfp8_codec.py --check --sweep

``--check``  compares the fast kernel (``quantize_kernel``: Triton on sm_89+) with
             ``quantize_reference`` byte-for-byte (q and scale bytes) on random and edge-case
             inputs (zeros, -0, fp32/bf16 subnormals, random bit patterns, +-448*2^k and
             +-512*2^k neighbours, E4M3 rounding ties, huge values, NaN/Inf), both rules,
             fp32/bf16/fp16, ragged grids, every swept Triton config, and the 1 GiB tensor;
             also reference-on-CUDA vs reference-on-CPU.
benchmark    (always) a 1 GiB bf16 tensor ([32768, 16384] by default):
             copy bandwidth = bytes read + written by ``y.copy_(x)`` / time;
             quantize bandwidth = (bytes read + q bytes + scale bytes) / time;
             ratio = quantize / copy (goal >= 0.90). Timing: CUDA events around a batch of
             back-to-back calls (launch overhead hidden), warm-up, median of repeats.
``--sweep``  also times every Triton config (groups per program x warps x eviction hint).

The last line printed is one JSON object with the results.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time

import torch

from weight_bus.codecs import mxfp8, mxfp8_triton

GiB = 1 << 30


# ------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------


def _f32_from_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


class _Blocks:
    """The 32-element blocks of ``edge_case_tensor``, drawn from one generator in a fixed order."""

    def __init__(self, seed: int):
        self.g = torch.Generator().manual_seed(seed)
        self.blocks: list[torch.Tensor] = []

    def rnd(self, n: int = 32) -> torch.Tensor:
        return torch.randn(n, generator=self.g)

    def block(self, first: list[float] | torch.Tensor, fill: torch.Tensor | None = None) -> None:
        """A block of ``fill`` (zeros by default) whose first elements are ``first``."""
        b = torch.zeros(32) if fill is None else fill.clone()
        first = torch.as_tensor(first, dtype=torch.float32)
        b[: first.numel()] = first
        self.blocks.append(b)


def _zeros_and_subnormals(b: _Blocks) -> None:
    b.block([0.0])  # all zero
    b.block(torch.full((32,), -0.0))  # all -0
    # fp32 subnormals: random mantissas, random signs; and subnormals next to a normal
    for _ in range(4):
        m = torch.randint(1, 1 << 23, (32,), generator=b.g)
        sgn = torch.randint(0, 2, (32,), generator=b.g) << 31
        b.blocks.append(_f32_from_bits(m | sgn))
    m = torch.randint(1, 1 << 23, (32,), generator=b.g)
    b.block([1.0, -(2.0**-120)], _f32_from_bits(m))
    b.block([2.0**-126, -(2.0**-127)], _f32_from_bits(torch.randint(1, 1 << 23, (32,), generator=b.g)))


def _scale_boundaries(b: _Blocks) -> None:
    # the smallest E8M0 scales: amax near 448 * 2**-127 and friends
    for k in range(-150, -110):
        b.block([2.0**k, -(2.0 ** (k - 3)), 3 * 2.0 ** (k - 5)], b.rnd() * 2.0 ** (k - 2))
    # block max around 448 * 2**k and 512 * 2**k (both rules' boundaries), fp32 neighbours
    for k in range(-135, 120):
        for base in (448.0 * 2.0**k, 512.0 * 2.0**k, 256.0 * 2.0**k):
            if base > torch.finfo(torch.float32).max:
                continue
            t = torch.tensor(base, dtype=torch.float32)
            for v in (t, t.nextafter(torch.tensor(math.inf)), t.nextafter(torch.tensor(0.0))):
                if math.isfinite(v.item()):
                    b.block([v.item(), -v.item()], b.rnd() * base / 8)
    # huge values
    fmax = torch.finfo(torch.float32).max
    b.block([1e38, -3e38, 2.5e37, 1.0])
    b.block([fmax, -fmax, fmax / 2, 1e30])
    b.block([3.3e38], b.rnd() * 1e37)


def _rounding_ties(b: _Blocks) -> None:
    # E4M3 rounding ties at scale 2**0: midpoints between consecutive E4M3 values (+ subnormals)
    e4m3 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mids = (e4m3[:-1] + e4m3[1:]) / 2
    for i in range(0, mids.numel(), 31):
        chunk = mids[i : i + 31]
        b.block([448.0] + chunk.tolist() + (-chunk).tolist()[: 31 - chunk.numel()])
    for i in range(0, mids.numel(), 31):
        chunk = -mids[i : i + 31]
        b.block([-448.0] + chunk.tolist())


def _non_finite_and_random_bits(b: _Blocks) -> None:
    for bad in (math.nan, math.inf, -math.inf):
        b.block([1.0, bad], b.rnd())
    b.block([math.nan] * 32)
    # random finite bit patterns over the whole fp32 range (NaN/Inf excluded), and with them
    bits = torch.randint(-(2**31), 2**31 - 1, (64, 32), generator=b.g, dtype=torch.int64)
    exponent = torch.randint(0, 0xFF, (64, 32), generator=b.g, dtype=torch.int64)  # 0..254: finite
    bits = (bits & ~0x7F800000) | (exponent << 23)
    b.blocks.extend(_f32_from_bits(bits).unbind(0))
    b.blocks.extend(_f32_from_bits(torch.randint(-(2**31), 2**31 - 1, (16, 32), generator=b.g)).unbind(0))


def edge_case_tensor(seed: int = 0) -> torch.Tensor:
    """fp32 [R, 64] tensor (CPU) whose 32-element blocks hit the codec's edge cases."""
    b = _Blocks(seed)
    _zeros_and_subnormals(b)
    _scale_boundaries(b)
    _rounding_ties(b)
    _non_finite_and_random_bits(b)
    if len(b.blocks) % 2:
        b.block([0.5])
    return torch.stack(b.blocks).reshape(-1, 64)


def random_tensors(device: str, seed: int = 1) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    x = torch.randn(4096, 8192, generator=g)
    out.append(("randn[4096,8192]", x))
    mag = torch.exp2(torch.randint(-150, 126, (1024, 64, 1), generator=g).float())
    out.append(("wide_range[1024,2048]", (torch.randn(1024, 64, 32, generator=g) * mag).reshape(1024, 2048)))
    out.append(("ragged[7,96]", torch.randn(7, 96, generator=g) * 3))  # 21 groups: masked tail
    out.append(("ragged[333,160]", torch.randn(333, 160, generator=g) * 1e-3))
    out.append(("3d[3,5,4096]", torch.randn(3, 5, 4096, generator=g)))
    out.append(("t[256,512].T", torch.randn(512, 256, generator=g).t()))  # non-contiguous
    return [(n, t.to(device)) for n, t in out]


# ------------------------------------------------------------------------------------------
# check
# ------------------------------------------------------------------------------------------


def _same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> tuple[int, int]:
    qa, sa = a
    qb, sb = b
    assert qa.shape == qb.shape and sa.shape == sb.shape, (qa.shape, qb.shape, sa.shape, sb.shape)
    dq = int((qa.view(torch.uint8).cpu() != qb.view(torch.uint8).cpu()).sum())
    ds = int((sa.cpu() != sb.cpu()).sum())
    return dq, ds


def sweep_configs() -> list[dict]:
    return [
        {"groups": gr, "num_warps": w, "evict_first": ev}
        for gr, w, ev in itertools.product((32, 64, 128, 256, 512), (2, 4, 8), (False, True))
    ]


def run_check(big: torch.Tensor | None, configs: list[dict], dev: str = "cuda") -> dict:
    failures: list[str] = []
    n_cases = 0
    edge = edge_case_tensor()
    cases = [("edge", edge.to(dev))] + random_tensors(dev)
    for rule in mxfp8.RULES:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for name, x in cases:
                xx = x.to(dtype)
                ref = mxfp8.quantize_reference(xx, rule)
                got = mxfp8.quantize_kernel(xx, rule)
                n_cases += 1
                dq, ds = _same(got, ref)
                if dq or ds:
                    failures.append(f"kernel {rule} {dtype} {name}: q bytes diff {dq}, scale diff {ds}")
                if name == "edge" or name.startswith("ragged") or name.startswith("wide"):
                    # torch's CUDA cast == CPU cast (reference is device independent)
                    ref_cpu = mxfp8.quantize_reference(xx.cpu(), rule)
                    n_cases += 1
                    dq, ds = _same(ref, ref_cpu)
                    if dq or ds:
                        failures.append(f"reference cuda!=cpu {rule} {dtype} {name}: q {dq}, s {ds}")
                    d_gpu = mxfp8.dequantize(*ref, dtype=torch.float32).cpu()
                    d_cpu = mxfp8.dequantize(*ref_cpu, dtype=torch.float32)
                    n_cases += 1
                    if not torch.equal(d_gpu.nan_to_num(7.0), d_cpu.nan_to_num(7.0)):
                        failures.append(f"dequantize cuda!=cpu {rule} {dtype} {name}")
        # every Triton config, even and ragged grids
        for cfg in configs:
            for name, x in (("edge", cases[0][1]), ("randn", cases[1][1]), ("ragged", cases[4][1])):
                xx = mxfp8._prepare_input(x.to(torch.bfloat16), rule)
                got = mxfp8_triton.quantize_triton(xx, rule, **cfg)
                ref = mxfp8.quantize_reference(xx, rule)
                n_cases += 1
                dq, ds = _same(got, ref)
                if dq or ds:
                    failures.append(f"config {cfg} {rule} {name}: q {dq}, s {ds}")
        # torch.compile fallback path on CUDA
        for name, x in cases[:3]:
            got = mxfp8._quantize_compiled(x, rule)
            ref = mxfp8.quantize_reference(x, rule)
            n_cases += 1
            dq, ds = _same(got, ref)
            if dq or ds:
                failures.append(f"torch.compile {rule} {name}: q {dq}, s {ds}")
        if big is not None:
            got = mxfp8.quantize_kernel(big, rule)
            ref = mxfp8.quantize_reference(big, rule)
            n_cases += 1
            dq, ds = _same(got, ref)
            if dq or ds:
                failures.append(f"kernel {rule} 1GiB bf16: q {dq}, s {ds}")
            del got, ref
            torch.cuda.empty_cache()
    return {"cases": n_cases, "failures": failures, "passed": not failures}


# ------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------


def time_ms(fn, warmup: int = 3, reps: int = 7, batch: int = 10) -> float:
    """Median over ``reps`` of (time of ``batch`` back-to-back calls) / batch, in ms."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(batch):
            fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / batch)
    return statistics.median(out)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--cols", type=int, default=16384)
    ap.add_argument("--check", action="store_true", help="bit-exactness check kernel vs reference")
    ap.add_argument("--sweep", action="store_true", help="time every Triton config")
    ap.add_argument("--no-compare", action="store_true", help="skip eager/torch.compile comparisons")
    ap.add_argument("--reps", type=int, default=7)
    return ap.parse_args()


def device_info(dev: torch.device, args: argparse.Namespace) -> dict:
    import triton

    props = torch.cuda.get_device_properties(dev)
    return {
        "device": props.name,
        "sm": f"{props.major}.{props.minor}",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shape": [args.rows, args.cols],
        "dtype": "bfloat16",
        "default_config": mxfp8_triton.DEFAULT_TRITON_CONFIG,
        "uses_triton": mxfp8._use_triton(torch.empty(1, device=dev)),
    }


def check_section(x: torch.Tensor, sweep: bool) -> dict:
    """``--check``: kernel vs reference on every case (every swept config with ``--sweep``), printed."""
    t0 = time.time()
    chk = run_check(x, sweep_configs() if sweep else [mxfp8_triton.DEFAULT_TRITON_CONFIG])
    print(f"check: {'PASS' if chk['passed'] else 'FAIL'} ({chk['cases']} comparisons, {time.time() - t0:.1f} s)")
    for f in chk["failures"][:20]:
        print("  FAIL", f)
    return {"passed": chk["passed"], "cases": chk["cases"], "failures": chk["failures"][:20]}


class Bandwidth:
    """Times quantize-like calls on ``x`` against the copy bandwidth (bytes: read + q + scales)."""

    def __init__(self, x: torch.Tensor, reps: int):
        self.x, self.reps = x, reps
        in_bytes = x.numel() * x.element_size()
        self.quant_bytes = in_bytes + x.numel() + x.numel() // 32  # 1 byte per element, 1 per 32-block
        y = torch.empty_like(x)
        self.copy_ms = time_ms(lambda: y.copy_(x), reps=reps)
        self.copy_bw = 2 * in_bytes / (self.copy_ms * 1e-3) / 1e9
        y = None  # free the copy target before the quantize buffers
        print(
            f"copy      : {self.copy_ms:8.4f} ms  {self.copy_bw:8.1f} GB/s  (read+write {2 * in_bytes / GiB:.2f} GiB)"
        )

    def figures(self, ms: float) -> dict:
        bw = self.quant_bytes / (ms * 1e-3) / 1e9
        return {"ms": ms, "GBps": bw, "ratio": bw / self.copy_bw}

    def measure(self, label: str, fn) -> dict:
        result = self.figures(time_ms(fn, reps=self.reps))
        print(f"{label:10s}: {result['ms']:8.4f} ms  {result['GBps']:8.1f} GB/s  ratio {result['ratio']:.3f}")
        return result


def sweep_section(bandwidth: Bandwidth) -> list[dict]:
    """``--sweep``: every Triton config's figures (rceil)."""
    xp = mxfp8._prepare_input(bandwidth.x, "rceil")
    sweep = []
    for cfg in sweep_configs():
        figures = bandwidth.figures(
            time_ms(lambda cfg=cfg: mxfp8_triton.quantize_triton(xp, "rceil", **cfg), reps=bandwidth.reps)
        )
        sweep.append({**cfg, **figures})
        print(f"  sweep {cfg}: {figures['ms']:.4f} ms {figures['GBps']:.1f} GB/s ratio {figures['ratio']:.3f}")
    print(f"best config: {max(sweep, key=lambda r: r['GBps'])}")
    return sweep


def compare_section(bandwidth: Bandwidth) -> dict:
    """torch.compile and eager quantize, and eager dequantize, on the same tensor."""
    x, compare = bandwidth.x, {}
    try:
        compare["torch_compile"] = bandwidth.measure("compile", lambda: mxfp8._quantize_compiled(x, "rceil"))
    except Exception as e:  # pragma: no cover - informational only
        print("torch.compile comparison failed:", repr(e)[:300])
    compare["eager_reference"] = bandwidth.measure("eager", lambda: mxfp8.quantize_reference(x, "rceil"))
    q, s = mxfp8.quantize_kernel(x)
    dequantized = bandwidth.figures(time_ms(lambda: mxfp8.dequantize(q, s), reps=bandwidth.reps))
    print(
        f"dequant   : {dequantized['ms']:8.4f} ms  {dequantized['GBps']:8.1f} GB/s  "
        f"ratio {dequantized['ratio']:.3f} (eager torch)"
    )
    compare["dequantize_eager"] = dequantized
    return compare


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        print("CUDA is not available: this benchmark needs a GPU", file=sys.stderr)
        print(json.dumps({"error": "no cuda"}))
        return 2
    dev = torch.device("cuda")
    info = device_info(dev, args)
    print("#", json.dumps(info))
    torch.manual_seed(0)
    x = torch.randn(args.rows, args.cols, device=dev, dtype=torch.bfloat16)
    result: dict = dict(info)
    if args.check:
        result["check"] = check_section(x, args.sweep)
    bandwidth = Bandwidth(x, args.reps)
    res = {
        rule: bandwidth.measure(f"kernel/{rule}", lambda rule=rule: mxfp8.quantize_kernel(x, rule))
        for rule in mxfp8.RULES
    }
    if args.sweep:
        sweep = sweep_section(bandwidth)
        result["sweep_best"] = max(sweep, key=lambda r: r["GBps"])
        result["sweep"] = sweep
    compare = {} if args.no_compare else compare_section(bandwidth)
    result.update(
        {
            "copy_ms": bandwidth.copy_ms,
            "copy_GBps": bandwidth.copy_bw,
            "quant_bytes": bandwidth.quant_bytes,
            "quant_ms": res["rceil"]["ms"],
            "quant_GBps": res["rceil"]["GBps"],
            "ratio": res["rceil"]["ratio"],
            "floor": res["floor"],
            "compare": compare,
            "goal_met": res["rceil"]["ratio"] >= 0.90,
        }
    )
    print(json.dumps(result))
    return 0 if result.get("check", {}).get("passed", True) else 1


if __name__ == "__main__":
    sys.exit(main())
