"""CPU tests for the MXFP8 codec (weight_bus.codecs.mxfp8): round-trip error, scale and element bytes, edge cases.

The exact reference is checked against hand-computed bytes and the scale-rule definitions. Dtypes, shapes and
``should_quantize``: test_mxfp8_api.py; the fast path against the reference: test_mxfp8_fast_path.py. The CUDA
Triton kernel is checked bit-for-bit by ``benchmarks/mxfp8_codec.py --check`` on a GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.weight_bus.mxfp8_blocks import block, element_bytes, scale_byte
from weight_bus.codecs import mxfp8
from weight_bus.codecs.mxfp8 import dequantize, quantize, quantize_reference

pytestmark = pytest.mark.unit


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
    assert scale_byte([amax], rule) == expected
    assert scale_byte([-amax], rule) == expected  # sign does not matter


def test_element_bytes_hand_checked():
    # scale byte 127 (2**0): elements are plain E4M3 encodings
    x = block([448.0, 1.0, -1.0, 0.5, -448.0, 2.0**-9, 2.0**-10, 1.5 * 2.0**-10, 3 * 2.0**-10, 0.0, -0.0])
    q, s = quantize_reference(x)
    assert s.item() == 127
    assert element_bytes(q)[0, :11].tolist() == [
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
    assert (element_bytes(q)[0] == 0).all()
    d = dequantize(q, s, torch.float32)
    assert (d[0] == 0).all() and (d[1, :32] == 0).all() and (d[1, 64:] == 0).all()


def test_negative_zero_block_keeps_sign_and_scale_zero():
    x = torch.full((1, 32), -0.0)
    q, s = quantize_reference(x)
    assert s.item() == 0 and (element_bytes(q) == 0x80).all()
    d = dequantize(q, s, torch.float32)
    assert (d == 0).all() and torch.signbit(d).all()


def test_subnormal_fp32_inputs_scale_up_exactly_and_roundtrip():
    # block of fp32 subnormals: scale clamps to 2**-127, x * 2**127 is exact
    vals = [2.0**-130, -(2.0**-133), 3 * 2.0**-132, 2.0**-149, 1e-40, -1e-39]
    x = block(vals)
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
    x = block([2.0**-130, -(2.0**-128), 2.0**-133], dtype=torch.bfloat16)
    assert torch.equal(element_bytes(quantize_reference(x)[0]), element_bytes(quantize_reference(x.float())[0]))
    d = dequantize(*quantize_reference(x), torch.float32)
    assert d[0, :3].tolist() == [2.0**-130, -(2.0**-128), 2.0**-133]


def test_tiny_elements_next_to_large_amax_flush_to_signed_zero():
    x = block([1.0, 1e-40, -1e-40, -(2.0**-120), 2.0**-17, 2.0**-18])
    q, s = quantize_reference(x)
    assert s.item() == 119  # scale 2**-8
    b = element_bytes(q)[0].tolist()
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
    assert scale_byte([base]) == 127 + k
    assert scale_byte([down32]) == 127 + k
    assert scale_byte([up32]) == 128 + k
    # amax exactly 448 * 2**k encodes as 0x7E and decodes exactly
    q, s = quantize_reference(block([base, -base]))
    assert element_bytes(q)[0, :2].tolist() == [0x7E, 0xFE]
    assert dequantize(q, s, torch.float32)[0, 0].item() == base


@pytest.mark.parametrize("k", [-100, -3, 0, 5, 110])
def test_floor_rule_around_512_times_power_of_two_saturates(k):
    top = 512.0 * 2.0**k
    below = torch.tensor(top, dtype=torch.float32).nextafter(torch.tensor(0.0)).item()
    assert scale_byte([top], "floor") == 128 + k
    assert scale_byte([below], "floor") == 127 + k
    q, s = quantize_reference(block([below, 460.0 * 2.0**k, -500.0 * 2.0**k]), "floor")
    assert element_bytes(q)[0, :3].tolist() == [0x7E, 0x7E, 0xFE]  # all saturated to +-448
    assert dequantize(q, s, torch.float32)[0, 0].item() == 448.0 * 2.0**k


def test_floor_rule_saturates_block_max_while_rceil_does_not():
    x = block([500.0, 1.0])
    qf, sf = quantize_reference(x, "floor")
    qr, sr = quantize_reference(x, "rceil")
    assert sf.item() == 127 and dequantize(qf, sf, torch.float32)[0, 0].item() == 448.0  # clipped
    assert sr.item() == 128 and dequantize(qr, sr, torch.float32)[0, 0].item() == 512.0  # rounded


def test_huge_values_decode_finite_within_half_ulp():
    x = block([1e38, -3e38, 2.5e37, 1.0])
    for rule in mxfp8.RULES:
        q, s = quantize_reference(x, rule)
        d = dequantize(q, s, torch.float32).double()
        assert torch.isfinite(d).all()
        rel = (d[0, :3] - x.double()[0, :3]).abs() / x.double()[0, :3].abs()
        assert (rel <= (2.0**-4 if rule == "rceil" else 0.125)).all(), (rule, rel)
        assert d[0, 3].item() == 0.0  # 1.0 is far below the block grid


def test_fp32_max_rounds_up_to_inf_on_decode_documented_limit():
    # (2 - 2**-23) * 2**127 / 2**120 rounds to 256 in E4M3 -> 2**128 overflows fp32 on decode
    x = block([torch.finfo(torch.float32).max])
    q, s = quantize_reference(x)
    assert s.item() == 247 and element_bytes(q)[0, 0].item() == 0x78  # 256
    assert dequantize(q, s, torch.float32)[0, 0].item() == math.inf


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nan_or_inf_block_gets_scale_255_and_decodes_to_nan(bad):
    x = torch.randn(2, 96)
    x[1, 40] = bad
    for rule in mxfp8.RULES:
        q, s = quantize_reference(x, rule)
        assert s[1, 1].item() == mxfp8.SCALE_NAN
        assert (element_bytes(q)[1, 32:64] == 0x7F).all()
        assert (s[0] != 255).all() and s[1, 0].item() != 255 and s[1, 2].item() != 255
        d = dequantize(q, s, torch.float32)
        assert torch.isnan(d[1, 32:64]).all()
        assert torch.isfinite(d[0]).all() and torch.isfinite(d[1, :32]).all() and torch.isfinite(d[1, 64:]).all()
