"""CPU tests for the MXFP8 codec (weight_bus.codecs.mxfp8).

The exact reference is checked against hand-computed bytes and the scale-rule definitions;
the fast path is checked bit-for-bit against it (torch.compile on CPU, marked ``slow``; the
Triton kernel's logic through the Triton interpreter). The CUDA Triton kernel is checked bit-for-bit by
``benchmarks/mxfp8_codec.py --check`` on a GPU.
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

from weight_bus.codecs import mxfp8
from weight_bus.codecs.mxfp8 import dequantize, quantize, quantize_kernel, quantize_reference, should_quantize

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[2]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _block(values, fill: float = 0.0, dtype=torch.float32) -> torch.Tensor:
    """One 32-element block [1, 32] starting with ``values``."""
    t = torch.full((1, 32), fill, dtype=torch.float64)
    t[0, : len(values)] = torch.tensor(values, dtype=torch.float64)
    return t.to(dtype)


def _scale_byte(values, rule="rceil", dtype=torch.float32) -> int:
    return int(quantize_reference(_block(values, dtype=dtype), rule)[1].item())


def _e4m3_half_ulp(y: torch.Tensor) -> torch.Tensor:
    """Half an E4M3 ulp at |y| (float64), subnormal spacing 2**-9 below 2**-6."""
    a = y.abs().to(torch.float64)
    e = torch.floor(torch.log2(a.clamp_min(2.0**-6)))
    return 0.5 * torch.exp2(e - 3)


# ------------------------------------------------------------------------------------------
# round-trip error
# ------------------------------------------------------------------------------------------


def test_roundtrip_relative_rms_error_is_about_2_7_percent_for_rceil_on_gaussian():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 1024, generator=g)
    q, s = quantize_reference(x, "rceil")
    d = dequantize(q, s, torch.float32)
    rel = ((d - x).norm() / x.norm()).item()
    assert 0.024 < rel < 0.029, rel  # rl-facts 2: 2.66% for RCEIL
    # elements landing in E4M3's normal range: at most half an ulp at 3 mantissa bits
    scaled = x.abs() / torch.exp2(s.float() - 127).repeat_interleave(32, dim=-1)
    normal = scaled >= 2.0**-6
    assert (((d - x).abs() / x.abs())[normal] <= 2.0**-4).all()


def test_roundtrip_relative_rms_error_floor_rule_is_slightly_worse_than_rceil():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 1024, generator=g)
    errs = {}
    for rule in mxfp8.RULES:
        q, s = quantize_reference(x, rule)
        errs[rule] = ((dequantize(q, s, torch.float32) - x).norm() / x.norm()).item()
    assert 0.027 < errs["floor"] < 0.032, errs  # rl-facts 2: 2.93%
    assert errs["floor"] > errs["rceil"]


def test_rceil_never_clips_error_within_half_ulp_of_block_scale_grid():
    g = torch.Generator().manual_seed(2)
    # wide dynamic range per block, including blocks whose scale clamps at 2**-127
    mag = torch.exp2(torch.randint(-150, 126, (256, 8, 1), generator=g).double())
    x = (torch.randn(256, 8, 32, generator=g, dtype=torch.float64) * mag).float().reshape(256, 256)
    q, s = quantize_reference(x, "rceil")
    d = dequantize(q, s, torch.float32).double()
    S = torch.exp2(s.double() - 127).repeat_interleave(32, dim=-1)
    y = x.double() / S  # exact scaled value (float64)
    assert y.abs().max().item() <= 448.0  # never clips
    assert ((d - x.double()).abs() <= _e4m3_half_ulp(y) * S).all()


def test_bf16_roundtrip_returns_bf16_and_is_exact_on_the_grid():
    x = torch.randn(64, 128, dtype=torch.bfloat16)
    q, s = quantize(x)
    d = dequantize(q, s)  # bf16 default
    assert d.dtype == torch.bfloat16 and d.shape == x.shape
    # re-encoding decoded values is lossless: they lie on the grid (the scale may drop by one
    # when the block max rounded down to <= 224 * scale, which is still exact)
    q2, s2 = quantize(d)
    assert torch.equal(dequantize(q2, s2), d)
    assert ((s.int() - s2.int()) >= 0).all() and ((s.int() - s2.int()) <= 1).all()


# ------------------------------------------------------------------------------------------
# scale bytes, hand-checked
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "amax, rule, expected",
    [
        (448.0, "rceil", 127),  # 448 / 2**0 == 448 fits exactly
        (449.0, "rceil", 128),
        (447.0, "rceil", 127),
        (1.0, "rceil", 119),  # 1 / 2**-8 = 256 <= 448; 2**-9 would give 512
        (1.75, "rceil", 119),  # 1.75 * 2**8 = 448
        (1.8, "rceil", 120),
        (1.0, "floor", 119),  # OCP: floor(log2 1) - 8 = -8 -> 127 - 8
        (448.0, "floor", 127),
        (511.0, "floor", 127),
        (512.0, "floor", 128),
        (0.0, "rceil", 0),
        (0.0, "floor", 0),
        (1e38, "rceil", 245),  # 1e38 = 1.175 * 2**126 -> e = 118
        (1e38, "floor", 245),
        (3.4028234663852886e38, "rceil", 247),  # fp32 max
        (3.4028234663852886e38, "floor", 246),
        (1e-40, "rceil", 0),  # fp32 subnormal amax: exponent clamps to -127
        (1e-40, "floor", 0),
        (2.0**-117, "floor", 2),  # floor(log2) - 8 = -125 -> byte 2
        (2.0**-119, "floor", 0),
        (2.0**-125, "floor", 0),  # -133 clamps to -127
        (448 * 2.0**-126, "rceil", 1),
        (448 * 2.0**-127, "rceil", 0),
        (448 * 2.0**-130, "rceil", 0),  # clamped; 448 * 2**-130 / 2**-127 = 56 still fits
    ],
)
def test_scale_byte_hand_checked(amax, rule, expected):
    assert _scale_byte([amax], rule) == expected
    assert _scale_byte([-amax], rule) == expected  # sign does not matter


def test_element_bytes_hand_checked():
    # scale byte 127 (2**0): elements are plain E4M3 encodings
    x = _block([448.0, 1.0, -1.0, 0.5, -448.0, 2.0**-9, 2.0**-10, 1.5 * 2.0**-10, 3 * 2.0**-10, 0.0, -0.0])
    q, s = quantize_reference(x)
    assert s.item() == 127
    assert _bytes(q)[0, :11].tolist() == [
        0x7E,  # 448 = 1.75 * 2**8
        0x38,  # 1.0
        0xB8,  # -1.0
        0x30,  # 0.5
        0xFE,  # -448
        0x01,  # 2**-9: smallest subnormal
        0x00,  # 2**-10: tie -> even (0)
        0x01,  # 1.5 * 2**-10 -> 2**-9
        0x02,  # 3 * 2**-10 = 1.5 * 2**-9: tie -> even (2 * 2**-9)
        0x00,
        0x80,  # -0.0 keeps its sign
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_bytes_match_rule_definitions_for_random_amax(dtype):
    g = torch.Generator().manual_seed(3)
    mag = torch.exp2(torch.randint(-140, 127, (4096, 1), generator=g).double())
    x = (torch.rand(4096, 32, generator=g, dtype=torch.float64) * 1.999 * mag).to(dtype)
    amax = x.double().abs().amax(-1)
    for rule in mxfp8.RULES:
        s = quantize_reference(x, rule)[1][:, 0].double()
        lo = torch.exp2(s - 127)  # the chosen scale
        if rule == "rceil":
            # smallest power of two S (>= 2**-127) with amax / S <= 448
            assert (amax / lo <= 448).all()
            ok_smaller = (s == 0) | (amax / (lo / 2) > 448)
            assert ok_smaller.all()
        else:
            # S = 2**(floor(log2 amax) - 8), clamped at 2**-127: amax / S in [256, 512)
            r = amax / lo
            assert ((r >= 256) | (s == 0)).all() and (r < 512).all()


# ------------------------------------------------------------------------------------------
# edge cases
# ------------------------------------------------------------------------------------------


def test_all_zero_block_gets_scale_zero_and_decodes_to_zeros():
    x = torch.zeros(2, 96)
    x[1, 32:64] = torch.randn(32)
    q, s = quantize_reference(x)
    assert s[0].tolist() == [0, 0, 0] and s[1, 0].item() == 0 and s[1, 2].item() == 0
    assert s[1, 1].item() != 0
    assert (_bytes(q)[0] == 0).all()
    d = dequantize(q, s, torch.float32)
    assert (d[0] == 0).all() and (d[1, :32] == 0).all() and (d[1, 64:] == 0).all()


def test_negative_zero_block_keeps_sign_and_scale_zero():
    x = torch.full((1, 32), -0.0)
    q, s = quantize_reference(x)
    assert s.item() == 0 and (_bytes(q) == 0x80).all()
    d = dequantize(q, s, torch.float32)
    assert (d == 0).all() and torch.signbit(d).all()


def test_subnormal_fp32_inputs_scale_up_exactly_and_roundtrip():
    # block of fp32 subnormals: scale clamps to 2**-127, x * 2**127 is exact
    vals = [2.0**-130, -(2.0**-133), 3 * 2.0**-132, 2.0**-149, 1e-40, -1e-39]
    x = _block(vals)
    assert (x[0, :6].abs() < 2.0**-126).all()  # really subnormal in fp32
    q, s = quantize_reference(x, "rceil")
    assert s.item() == 0
    d = dequantize(q, s, torch.float32)
    # powers of two in E4M3's range come back bit-exactly (exact decode with scale 2**-127)
    assert d[0, 0].item() == 2.0**-130 and d[0, 1].item() == -(2.0**-133)
    assert d[0, 2].item() == 3 * 2.0**-132
    assert d[0, 3].item() == 0.0  # 2**-149 * 2**127 = 2**-22 < half the smallest E4M3 subnormal
    ref = x.double()[0, 4:6]
    assert ((d.double()[0, 4:6] - ref).abs() / ref.abs() <= 2.0**-4).all()


def test_subnormal_bf16_inputs_match_their_fp32_upcast():
    x = _block([2.0**-130, -(2.0**-128), 2.0**-133], dtype=torch.bfloat16)
    assert torch.equal(_bytes(quantize_reference(x)[0]), _bytes(quantize_reference(x.float())[0]))
    d = dequantize(*quantize_reference(x), torch.float32)
    assert d[0, :3].tolist() == [2.0**-130, -(2.0**-128), 2.0**-133]


def test_tiny_elements_next_to_large_amax_flush_to_signed_zero():
    x = _block([1.0, 1e-40, -1e-40, -(2.0**-120), 2.0**-17, 2.0**-18])
    q, s = quantize_reference(x)
    assert s.item() == 119  # scale 2**-8
    b = _bytes(q)[0].tolist()
    assert b[1:4] == [0x00, 0x80, 0x80]
    assert b[4] == 0x01  # 2**-17 / 2**-8 = 2**-9: smallest E4M3 subnormal
    assert b[5] == 0x00  # 2**-18 -> 2**-10 ties to even zero


@pytest.mark.parametrize("k", [-125, -100, -40, -8, -1, 0, 1, 7, 40, 100, 119])
def test_rceil_values_around_448_times_power_of_two(k):
    base = 448.0 * 2.0**k
    up = math.nextafter(base, math.inf)
    down = math.nextafter(base, 0.0)
    # fp32 neighbours (python floats are float64): round-trip through float32
    up32 = torch.tensor(base, dtype=torch.float32).nextafter(torch.tensor(math.inf)).item()
    down32 = torch.tensor(base, dtype=torch.float32).nextafter(torch.tensor(0.0)).item()
    assert up32 > base > down32 and up > base > down
    assert _scale_byte([base]) == 127 + k
    assert _scale_byte([down32]) == 127 + k
    assert _scale_byte([up32]) == 128 + k
    # amax exactly 448 * 2**k encodes as 0x7E and decodes exactly
    q, s = quantize_reference(_block([base, -base]))
    assert _bytes(q)[0, :2].tolist() == [0x7E, 0xFE]
    assert dequantize(q, s, torch.float32)[0, 0].item() == base


@pytest.mark.parametrize("k", [-100, -3, 0, 5, 110])
def test_floor_rule_around_512_times_power_of_two_saturates(k):
    top = 512.0 * 2.0**k
    below = torch.tensor(top, dtype=torch.float32).nextafter(torch.tensor(0.0)).item()
    assert _scale_byte([top], "floor") == 128 + k
    assert _scale_byte([below], "floor") == 127 + k
    q, s = quantize_reference(_block([below, 460.0 * 2.0**k, -500.0 * 2.0**k]), "floor")
    assert _bytes(q)[0, :3].tolist() == [0x7E, 0x7E, 0xFE]  # all saturated to +-448
    assert dequantize(q, s, torch.float32)[0, 0].item() == 448.0 * 2.0**k


def test_floor_rule_saturates_block_max_while_rceil_does_not():
    x = _block([500.0, 1.0])
    qf, sf = quantize_reference(x, "floor")
    qr, sr = quantize_reference(x, "rceil")
    assert sf.item() == 127 and dequantize(qf, sf, torch.float32)[0, 0].item() == 448.0  # clipped
    assert sr.item() == 128 and dequantize(qr, sr, torch.float32)[0, 0].item() == 512.0  # rounded


def test_huge_values_decode_finite_within_half_ulp():
    x = _block([1e38, -3e38, 2.5e37, 1.0])
    for rule in mxfp8.RULES:
        q, s = quantize_reference(x, rule)
        d = dequantize(q, s, torch.float32).double()
        assert torch.isfinite(d).all()
        rel = (d[0, :3] - x.double()[0, :3]).abs() / x.double()[0, :3].abs()
        assert (rel <= (2.0**-4 if rule == "rceil" else 0.125)).all(), (rule, rel)
        assert d[0, 3].item() == 0.0  # 1.0 is far below the block grid


def test_fp32_max_rounds_up_to_inf_on_decode_documented_limit():
    # (2 - 2**-23) * 2**127 / 2**120 rounds to 256 in E4M3 -> 2**128 overflows fp32 on decode
    x = _block([torch.finfo(torch.float32).max])
    q, s = quantize_reference(x)
    assert s.item() == 247 and _bytes(q)[0, 0].item() == 0x78  # 256
    assert dequantize(q, s, torch.float32)[0, 0].item() == math.inf


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nan_or_inf_block_gets_scale_255_and_decodes_to_nan(bad):
    x = torch.randn(2, 96)
    x[1, 40] = bad
    for rule in mxfp8.RULES:
        q, s = quantize_reference(x, rule)
        assert s[1, 1].item() == mxfp8.SCALE_NAN
        assert (_bytes(q)[1, 32:64] == 0x7F).all()
        assert (s[0] != 255).all() and s[1, 0].item() != 255 and s[1, 2].item() != 255
        d = dequantize(q, s, torch.float32)
        assert torch.isnan(d[1, 32:64]).all()
        assert torch.isfinite(d[0]).all() and torch.isfinite(d[1, :32]).all() and torch.isfinite(d[1, 64:]).all()


# ------------------------------------------------------------------------------------------
# dtypes, shapes, API
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_bf16_fp16_fp64_inputs_equal_quantizing_their_fp32_value(dtype):
    x = (torch.randn(16, 64, dtype=torch.float64) * 10).to(dtype)
    for rule in mxfp8.RULES:
        q, s = quantize_reference(x, rule)
        q32, s32 = quantize_reference(x.float(), rule)
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.uint8
        assert torch.equal(_bytes(q), _bytes(q32)) and torch.equal(s, s32)


def test_non_float_input_raises_type_error():
    with pytest.raises(TypeError):
        quantize_reference(torch.ones(2, 32, dtype=torch.int32))


def test_3d_tensor_blocks_run_along_last_dim():
    x = torch.randn(2, 3, 64)
    x[1, 2, 32:] *= 1000
    q, s = quantize_reference(x)
    assert q.shape == (2, 3, 64) and s.shape == (2, 3, 2)
    q2, s2 = quantize_reference(x.reshape(6, 64))
    assert torch.equal(_bytes(q).reshape(6, 64), _bytes(q2)) and torch.equal(s.reshape(6, 2), s2)
    assert s[1, 2, 1] > s[1, 2, 0]
    d = dequantize(q, s, torch.float32)
    assert d.shape == x.shape and ((d - x).norm() / x.norm()).item() < 0.05


def test_1d_tensor_of_multiple_of_32_is_accepted():
    q, s = quantize_reference(torch.randn(64))
    assert q.shape == (64,) and s.shape == (2,)


@pytest.mark.parametrize("shape", [(4, 48), (2, 3, 33), (31,)])
def test_last_dim_not_multiple_of_32_raises_value_error_naming_shape(shape):
    for fn in (quantize_reference, quantize, quantize_kernel):
        with pytest.raises(ValueError, match=str(tuple(shape)).replace("(", r"\(").replace(")", r"\)")):
            fn(torch.randn(shape))


def test_unknown_rule_raises_value_error():
    with pytest.raises(ValueError, match="rule"):
        quantize_reference(torch.randn(1, 32), "ceil")


def test_empty_tensor_gives_empty_outputs():
    q, s = quantize_reference(torch.empty(0, 64))
    assert q.shape == (0, 64) and s.shape == (0, 2)
    assert dequantize(q, s).shape == (0, 64)


def test_non_contiguous_input_gives_same_bytes_as_contiguous():
    x = torch.randn(64, 96).t()  # [96, 64], non-contiguous
    q, s = quantize_reference(x)
    q2, s2 = quantize_reference(x.contiguous())
    assert torch.equal(_bytes(q), _bytes(q2)) and torch.equal(s, s2)


def test_quantize_on_cpu_equals_reference():
    x = torch.randn(8, 256, dtype=torch.bfloat16)
    for rule in mxfp8.RULES:
        q, s = quantize(x, rule)
        qr, sr = quantize_reference(x, rule)
        assert torch.equal(_bytes(q), _bytes(qr)) and torch.equal(s, sr)


def test_dequantize_checks_dtypes_and_shapes():
    q, s = quantize_reference(torch.randn(4, 64))
    with pytest.raises(ValueError):
        dequantize(q, s[:, :1])
    with pytest.raises(TypeError):
        dequantize(q, s.to(torch.int32))
    with pytest.raises(TypeError):
        dequantize(q.float(), s)
    # a uint8 view of q is accepted
    assert torch.equal(dequantize(_bytes(q), s), dequantize(q, s))


def test_dequantize_scale_byte_extremes():
    q = torch.full((1, 32), 1.0).to(torch.float8_e4m3fn)
    for byte, val in [(0, 2.0**-127), (1, 2.0**-126), (127, 1.0), (254, 2.0**127)]:
        s = torch.tensor([[byte]], dtype=torch.uint8)
        assert dequantize(q, s, torch.float32)[0, 0].item() == val
    assert torch.isnan(dequantize(q, torch.tensor([[255]], dtype=torch.uint8), torch.float32)).all()


# ------------------------------------------------------------------------------------------
# should_quantize
# ------------------------------------------------------------------------------------------

W = torch.empty(64, 128, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "name, tensor, expected",
    [
        ("model.layers.0.self_attn.q_proj.weight", W, True),
        ("model.layers.0.mlp.gate_proj.weight", W, True),
        ("model.layers.0.mlp.experts.3.down_proj.weight", W, True),
        ("model.layers.0.mlp.experts.w13_weight", torch.empty(4, 64, 128), True),  # 3-D stacked experts
        ("model.layers.0.input_layernorm.weight", W, False),
        ("model.layers.0.self_attn.q_norm.weight", W, False),
        ("model.norm.weight", W, False),
        ("model.layers.0.self_attn.q_proj.bias", W, False),
        ("model.layers.0.mlp.gate.weight", W, False),  # router
        ("model.layers.0.block_sparse_moe.gate.weight", W, False),  # Mixtral router
        ("model.layers.0.mlp.shared_expert_gate.weight", torch.empty(1, 128), False),
        ("decoder.layers.0.mlp.router.weight", W, False),
        ("model.layers.0.mlp.gate.e_score_correction_bias", torch.empty(8, 32), False),
        ("model.embed_tokens.weight", W, False),
        ("lm_head.weight", W, False),
        ("model.layers.0.self_attn.o_proj.weight", torch.empty(128), False),  # 1-D
        ("model.layers.0.self_attn.o_proj.weight", torch.empty(64, 48), False),  # K % 32 != 0
        ("model.layers.0.self_attn.o_proj.weight", torch.empty(64, 128, dtype=torch.int8), False),
        ("model.layers.0.self_attn.o_proj.weight", torch.empty(64, 128, dtype=torch.float8_e4m3fn), False),
        ("model.layers.0.self_attn.o_proj.weight", torch.empty(64, 128, dtype=torch.float32), True),
    ],
)
def test_should_quantize_cases(name, tensor, expected):
    assert should_quantize(name, tensor) is expected


def test_should_quantize_embeddings_and_lm_head_only_when_flagged():
    assert should_quantize("model.embed_tokens.weight", W, quantize_embeddings=True)
    assert not should_quantize("model.embed_tokens.weight", W, quantize_lm_head=True)
    assert should_quantize("lm_head.weight", W, quantize_lm_head=True)
    assert not should_quantize("lm_head.weight", W, quantize_embeddings=True)
    # flags do not override the shape rules
    assert not should_quantize("lm_head.weight", torch.empty(64, 50), quantize_lm_head=True)


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
            assert torch.equal(_bytes(q), _bytes(qr)), (dtype, rule)
            assert torch.equal(s, sr), (dtype, rule)


_INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import math, torch
    from weight_bus.codecs import mxfp8 as m
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
                q, s = m._quantize_triton(xx, rule, groups=groups)
                qr, sr = m.quantize_reference(xx, rule)
                bad += int(not torch.equal(q.view(torch.uint8), qr.view(torch.uint8)))
                bad += int(not torch.equal(s, sr))
            # random data: scale bytes must agree (the interpreter's fp8 cast is not RNE)
            xr = torch.randn(40, 256, generator=g).to(dtype) * 1e3
            bad += int(not torch.equal(m._quantize_triton(xr, rule, groups=16)[1], m.quantize_reference(xr, rule)[1]))
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
