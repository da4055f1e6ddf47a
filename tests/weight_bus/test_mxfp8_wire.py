"""The mxfp8 wire codec end to end on CPU: a tiny Qwen3-MoE packed by the publisher side, received by
the rollout side with and without dequantization, and the layout planner that a broadcast uses."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from modeling.tiny_model import init_tiny
from weight_bus.codecs.mxfp8 import dequantize, quantize
from weight_bus.packing import (
    ChecksumError,
    WireCodec,
    encoded_metas,
    iter_tensors,
    pack,
    plan_layout,
    total_nbytes,
    verify,
)

pytestmark = pytest.mark.unit

MXFP8 = WireCodec("mxfp8")
ROUTER_BIAS = "model.layers.0.mlp.gate.e_score_correction_bias"
PROJ_BIAS = "model.layers.0.self_attn.q_proj.bias"
NEVER_QUANTIZED = ("norm", "mlp.gate.weight", "embed_tokens", "lm_head", ".bias", "e_score_correction_bias")


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory) -> list[tuple[str, torch.Tensor]]:
    """The tiny MoE's checkpoint tensors in bf16, plus an fp32 router bias and a bf16 projection bias."""
    path = init_tiny(tmp_path_factory.mktemp("tiny"))
    state = load_file(str(path / "model.safetensors"))
    tensors = [(name, tensor.to(torch.bfloat16)) for name, tensor in sorted(state.items())]
    gen = torch.Generator().manual_seed(0)
    tensors.append((ROUTER_BIAS, torch.randn(8, generator=gen)))  # fp32 by design, must stay fp32
    tensors.append((PROJ_BIAS, torch.randn(64, generator=gen).to(torch.bfloat16)))
    return tensors


def _joined(buckets) -> bytearray:
    return bytearray(b"".join(bytes(b) for b in buckets))


def _is_eligible(name: str, tensor: torch.Tensor) -> bool:
    return tensor.dim() == 2 and not any(key in name for key in NEVER_QUANTIZED)


def test_mxfp8_received_with_dequantize_equals_dequantize_of_quantize_exactly(tiny_bf16):
    manifest, buckets = pack(tiny_bf16, 5, bytes_per_bucket=64 << 10, codec=MXFP8)
    buffer = _joined(buckets)
    verify(manifest, memoryview(buffer))
    received = dict(iter_tensors(manifest, memoryview(buffer), dequantize_to=torch.bfloat16))
    assert list(received) == [name for name, _ in tiny_bf16]  # pairs fold back, order kept
    num_quantized = 0
    for name, sent in tiny_bf16:
        got = received[name]
        assert got.shape == sent.shape, name
        if _is_eligible(name, sent):
            num_quantized += 1
            assert got.dtype == torch.bfloat16, name
            assert torch.equal(got, dequantize(*quantize(sent), torch.bfloat16)), name
            assert not torch.equal(got, sent), name  # it really went through MXFP8
        else:
            assert got.dtype == sent.dtype, name  # fp32 router bias stays fp32
            assert torch.equal(got.view(torch.uint8), sent.view(torch.uint8)), name  # bit-identical
    assert num_quantized == 2 * (24 + 4)  # per layer: 24 expert linears + q, k, v, o


def test_dequantize_to_float32_is_exact_too(tiny_bf16):
    fp32 = [(name, t.float()) for name, t in tiny_bf16]
    manifest, buckets = pack(fp32, 1, bytes_per_bucket=1 << 20, codec=MXFP8)
    received = dict(iter_tensors(manifest, memoryview(_joined(buckets)), dequantize_to=torch.float32))
    name, weight = next((n, t) for n, t in fp32 if n.endswith("experts.3.down_proj.weight"))
    assert torch.equal(received[name], dequantize(*quantize(weight), torch.float32))


def test_mxfp8_manifest_lists_pairs_in_checkpoint_format_without_dequantize(tiny_bf16):
    manifest, buckets = pack(tiny_bf16, 2, bytes_per_bucket=1 << 20, codec=MXFP8)
    entries = {entry.name: entry for entry in manifest.tensors}
    q_name = "model.layers.1.self_attn.q_proj.weight"
    assert (entries[q_name].codec, entries[q_name].dtype) == ("mxfp8", "float8_e4m3fn")
    assert (entries[q_name + "_scale"].codec, entries[q_name + "_scale"].dtype) == ("raw", "uint8")
    assert entries[q_name + "_scale"].shape == (64, 2)
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate.weight", ROUTER_BIAS):
        assert entries[name].codec == "raw" and name + "_scale" not in entries
    assert entries[ROUTER_BIAS].dtype == "float32"
    pairs = dict(iter_tensors(manifest, memoryview(_joined(buckets))))
    q, scale = quantize(dict(tiny_bf16)[q_name])
    assert torch.equal(pairs[q_name].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(pairs[q_name + "_scale"], scale)


def test_mxfp8_bytes_on_the_wire_are_about_half_of_bf16(tiny_bf16):
    raw_manifest, _ = pack(tiny_bf16, 1, bytes_per_bucket=1 << 20)
    mx_manifest, _ = pack(tiny_bf16, 1, bytes_per_bucket=1 << 20, codec=MXFP8)
    quantized = {e.name for e in mx_manifest.tensors if e.codec == "mxfp8"}
    raw_q = sum(e.nbytes for e in raw_manifest.tensors if e.name in quantized)
    mx_q = sum(e.nbytes for e in mx_manifest.tensors if e.name in quantized or e.name[:-6] in quantized)
    assert mx_q / raw_q == pytest.approx((8 + 8 / 32) / 16)  # 51.6%: rl-facts 1.6
    kept = sum(e.nbytes for e in raw_manifest.tensors if e.name not in quantized)
    ratio = total_nbytes(mx_manifest) / total_nbytes(raw_manifest)
    # Embeddings, LM head, router and norms stay bf16 (a large share of this toy model); padding is <1%.
    assert ratio == pytest.approx((kept + mx_q) / (kept + raw_q), abs=0.01)
    assert 0.52 < ratio < 0.56, ratio


def test_embeddings_and_lm_head_are_quantized_only_when_configured(tiny_bf16):
    codec = WireCodec("mxfp8", quantize_embeddings=True, quantize_lm_head=True)
    manifest, _ = pack(tiny_bf16, 1, bytes_per_bucket=1 << 20, codec=codec)
    codecs = {entry.name: entry.codec for entry in manifest.tensors}
    assert codecs["model.embed_tokens.weight"] == codecs["lm_head.weight"] == "mxfp8"
    assert codecs["model.layers.0.mlp.gate.weight"] == "raw"  # routers never


def test_floor_rule_reaches_the_wire(tiny_bf16):
    name, weight = next((n, t) for n, t in tiny_bf16 if n.endswith("o_proj.weight"))
    weight = weight.clone()
    weight[0, 0] = 500.0  # FLOOR clips this block's max, RCEIL does not
    manifest, buckets = pack([(name, weight)], 1, 1 << 20, codec=WireCodec("mxfp8", rule="floor"))
    got = dict(iter_tensors(manifest, memoryview(_joined(buckets)), dequantize_to=torch.float32))[name]
    assert torch.equal(got, dequantize(*quantize(weight, "floor"), torch.float32))
    assert got[0, 0] < 500.0


def test_corrupted_scale_byte_is_refused_naming_the_scale_tensor(tiny_bf16):
    manifest, buckets = pack(tiny_bf16, 9, bytes_per_bucket=1 << 20, codec=MXFP8)
    buffer = _joined(buckets)
    entry = next(e for e in manifest.tensors if e.name.endswith("o_proj.weight_scale"))
    buffer[sum(manifest.bucket_nbytes[: entry.bucket]) + entry.offset] ^= 0x01
    with pytest.raises(ChecksumError, match=r"v9: tensor model\.layers\.\d\.self_attn\.o_proj\.weight_scale"):
        verify(manifest, memoryview(buffer))


def test_plan_layout_from_metadata_matches_the_packed_layout(tiny_bf16):
    for codec, bucket in ((WireCodec(), 4096), (MXFP8, 4096), (MXFP8, 1 << 20)):
        manifest, _ = pack(tiny_bf16, 1, bytes_per_bucket=bucket, codec=codec)
        entries, sizes = plan_layout(encoded_metas(tiny_bf16, codec), bucket)
        assert sizes == manifest.bucket_nbytes
        assert [(e.name, e.dtype, e.shape, e.codec, e.bucket, e.offset, e.nbytes) for e in entries] == [
            (e.name, e.dtype, e.shape, e.codec, e.bucket, e.offset, e.nbytes) for e in manifest.tensors
        ]


def test_mxfp8_entry_without_its_scale_is_an_error_naming_it(tiny_bf16):
    some = [(n, t) for n, t in tiny_bf16 if "layers.0.mlp.experts.0." in n]
    manifest, buckets = pack(some, 1, bytes_per_bucket=1 << 20, codec=MXFP8)
    stripped = type(manifest)(
        manifest.version,
        [e for e in manifest.tensors if not e.name.endswith("_scale")],
        manifest.bucket_nbytes,
        "",
        "tcp",
        0.0,
    )
    with pytest.raises(ValueError, match=r"down_proj\.weight: MXFP8 entry without its .*_scale companion"):
        list(iter_tensors(stripped, memoryview(_joined(buckets)), dequantize_to=torch.bfloat16))
