"""CPU tests for the MXFP8 codec's API (weight_bus.codecs.mxfp8): dtypes, shapes, errors, ``should_quantize``."""

from __future__ import annotations

import pytest
import torch

from tests.weight_bus.mxfp8_blocks import element_bytes
from weight_bus.codecs import mxfp8
from weight_bus.codecs.mxfp8 import dequantize, quantize, quantize_kernel, quantize_reference, should_quantize

pytestmark = pytest.mark.unit


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
        assert torch.equal(element_bytes(q), element_bytes(q32)) and torch.equal(s, s32)


def test_non_float_input_raises_type_error():
    with pytest.raises(TypeError):
        quantize_reference(torch.ones(2, 32, dtype=torch.int32))


def test_3d_tensor_blocks_run_along_last_dim():
    x = torch.randn(2, 3, 64)
    x[1, 2, 32:] *= 1000
    q, s = quantize_reference(x)
    assert q.shape == (2, 3, 64) and s.shape == (2, 3, 2)
    q2, s2 = quantize_reference(x.reshape(6, 64))
    assert torch.equal(element_bytes(q).reshape(6, 64), element_bytes(q2)) and torch.equal(s.reshape(6, 2), s2)
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
    assert torch.equal(element_bytes(q), element_bytes(q2)) and torch.equal(s, s2)


def test_quantize_on_cpu_equals_reference():
    x = torch.randn(8, 256, dtype=torch.bfloat16)
    for rule in mxfp8.RULES:
        q, s = quantize(x, rule)
        qr, sr = quantize_reference(x, rule)
        assert torch.equal(element_bytes(q), element_bytes(qr)) and torch.equal(s, sr)


def test_dequantize_checks_dtypes_and_shapes():
    q, s = quantize_reference(torch.randn(4, 64))
    with pytest.raises(ValueError):
        dequantize(q, s[:, :1])
    with pytest.raises(TypeError):
        dequantize(q, s.to(torch.int32))
    with pytest.raises(TypeError):
        dequantize(q.float(), s)
    # a uint8 view of q is accepted
    assert torch.equal(dequantize(element_bytes(q), s), dequantize(q, s))


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
