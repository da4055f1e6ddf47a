"""MXFP8 weight codec (OCP Microscaling v1.0, E4M3 elements + E8M0 block scales).

Layout (compressed-tensors / vLLM checkpoint format)::

    weight        float8_e4m3fn  [..., K]
    weight_scale  uint8          [..., K // 32]   (biased E8M0, bias 127)
    decode:       w = float(q) * 2 ** (scale - 127)

One scale byte covers 32 consecutive elements along the last dimension.

Scale rules (``rule=``):

* ``"rceil"`` (default; cuBLAS / Transformer Engine / NVIDIA MXFP8 recipe): the smallest
  power of two ``S = 2**e`` with ``amax / S <= 448``. Never clips.
* ``"floor"`` (OCP MX spec section 6.3): ``S = 2**(floor(log2(amax)) - 8)``; scaled elements
  land in ``[-512, 512)`` and are saturated to +-448 (up to 12.5% error on the block max).

Both rules clamp the exponent to the E8M0 range ``[-127, 127]`` (byte ``0..254``).

Exactness: exponents are taken from the integer bits of the fp32 ``amax`` (no ``log2``), the
multiplier ``2**-e`` is built from bits and is always a normal fp32, so ``x * 2**-e`` is exact
except when the product is an fp32 subnormal (``|x * 2**-e| < 2**-126``); such values round to
+-0 in E4M3 anyway (the smallest E4M3 subnormal is ``2**-9``), so the result does not depend on
fp32 subnormal handling of the product. The final fp32 -> E4M3 cast is round-to-nearest-even.

Decisions (documented and tested):

* All-zero block -> scale byte 0 (``2**-127``), elements 0; decodes to zeros (signed zeros are
  kept: ``-0.0`` encodes as E4M3 byte ``0x80``).
* A block containing NaN or +-Inf -> scale byte 255 (E8M0 NaN, per the OCP spec) and all 32
  element bytes ``0x7F`` (E4M3 NaN). The whole block decodes to NaN. No host sync, no exception:
  callers that must reject non-finite weights check ``(scale == 255).any()``.
* The last dimension must be a multiple of 32: otherwise ``ValueError`` naming the shape (pad or
  keep such tensors in high precision; :func:`should_quantize` returns ``False`` for them).
* Decoding can overflow only at the very top of the fp32 range: |x| >= 248 * 2**120 (about 3.3e38)
  rounds to E4M3 256 at the largest scale 2**120, and 256 * 2**120 = 2**128 decodes to Inf.
* Accepted input dtypes: float32, bfloat16, float16 (bit-exact); float64 is first rounded to
  float32 (values beyond the fp32 range become Inf and hence a NaN block).
"""

from __future__ import annotations

import functools
import re

import torch

from weight_bus.codecs.mxfp8_triton import quantize_triton as _quantize_triton
from weight_bus.codecs.mxfp8_triton import triton_available

__all__ = [
    "BLOCK_SIZE",
    "E4M3_MAX",
    "SCALE_BIAS",
    "SCALE_NAN",
    "RULES",
    "quantize",
    "quantize_reference",
    "quantize_kernel",
    "dequantize",
    "should_quantize",
    "triton_available",
]

BLOCK_SIZE = 32
E4M3_MAX = 448.0
SCALE_BIAS = 127
SCALE_NAN = 255  # E8M0 NaN
Q_NAN_BYTE = 0x7F  # E4M3 (fn) NaN, positive sign
RULES = ("rceil", "floor")

# fp32 significand 1.75 (= 448 / 2**8) as the 23-bit mantissa field.
_RCEIL_MANTISSA_THRESHOLD = 0x600000
_FP32_ABS_MASK = 0x7FFFFFFF
_FP32_INF_BITS = 0x7F800000

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------------------------


def _check_rule(rule: str) -> None:
    if rule not in RULES:
        raise ValueError(f"unknown MXFP8 scale rule {rule!r}; expected one of {RULES}")


def _prepare_input(x: torch.Tensor, rule: str) -> torch.Tensor:
    """Validate ``x``/``rule`` and return a tensor of a supported dtype."""
    _check_rule(rule)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0:
        raise ValueError("MXFP8 quantize needs at least a 1-D tensor, got a 0-D tensor")
    if x.shape[-1] % BLOCK_SIZE != 0:
        raise ValueError(
            f"MXFP8 quantize: last dimension must be a multiple of {BLOCK_SIZE}, got shape {tuple(x.shape)}"
        )
    if x.dtype == torch.float64:
        x = x.to(torch.float32)
    elif x.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(
            f"MXFP8 quantize: unsupported dtype {x.dtype} for tensor of shape {tuple(x.shape)}; "
            "expected float32, bfloat16 or float16"
        )
    return x


def _scale_shape(shape: torch.Size) -> tuple[int, ...]:
    return tuple(shape[:-1]) + (shape[-1] // BLOCK_SIZE,)


# --------------------------------------------------------------------------------------------
# reference (pure torch, any device)
# --------------------------------------------------------------------------------------------


def _quantize_groups(xg: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``xg`` of shape ``[G, 32]`` (fp32/bf16/fp16).

    Returns ``(q_bytes uint8 [G, 32], scale uint8 [G])``. Pure torch ops only, so it runs
    eagerly on any device and can be ``torch.compile``'d.
    """
    xf = xg.to(torch.float32)
    abs_bits = xf.view(torch.int32) & _FP32_ABS_MASK
    # Integer max of |x| bit patterns == float max for finite values; Inf/NaN patterns are
    # larger than every finite one, so non-finite blocks show up as amax_bits >= 0x7F800000.
    amax_bits = abs_bits.amax(dim=-1)
    biased_exp = amax_bits >> 23  # floor(log2(amax)) + 127 for normal amax
    if rule == "rceil":
        # amax = m * 2**(E-127), m in [1, 2). amax <= 448 * 2**e  <=>  e >= E - 135 (m <= 1.75)
        # or e >= E - 134 (m > 1.75). byte = e + 127.
        round_up = ((amax_bits & 0x7FFFFF) > _RCEIL_MANTISSA_THRESHOLD).to(torch.int32)
        scale_i = biased_exp - 8 + round_up
    else:  # "floor": e = floor(log2(amax)) - 8
        scale_i = biased_exp - 8
    # Subnormal / zero amax gives a negative byte -> clamp to 2**-127. Finite amax never
    # exceeds byte 247, the upper clamp only guards the E8M0 range.
    scale_i = scale_i.clamp(0, 254)
    # 2**(127 - byte): biased exponent 254 - byte in [7, 254] -> always a normal fp32.
    mult = ((254 - scale_i) << 23).view(torch.float32)
    y = xf * mult.unsqueeze(-1)
    if rule == "floor":
        y = y.clamp(-E4M3_MAX, E4M3_MAX)
    q = y.to(torch.float8_e4m3fn).view(torch.uint8)
    nonfinite = amax_bits >= _FP32_INF_BITS
    q = q.masked_fill(nonfinite.unsqueeze(-1), Q_NAN_BYTE)
    scale = scale_i.masked_fill(nonfinite, SCALE_NAN).to(torch.uint8)
    return q, scale


def _finish(x: torch.Tensor, q_bytes: torch.Tensor, scale: torch.Tensor):
    q = q_bytes.view(torch.float8_e4m3fn).reshape(x.shape)
    return q, scale.reshape(_scale_shape(x.shape))


def quantize_reference(x: torch.Tensor, rule: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """Exact pure-torch MXFP8 encoder (CPU or any device).

    Returns ``(q, scale)``: ``q`` float8_e4m3fn with ``x``'s shape, ``scale`` uint8 with shape
    ``x.shape[:-1] + (x.shape[-1] // 32,)``.
    """
    x = _prepare_input(x, rule)
    if x.numel() == 0:
        return (
            torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device),
            torch.empty(_scale_shape(x.shape), dtype=torch.uint8, device=x.device),
        )
    xg = x.reshape(-1, BLOCK_SIZE)
    q_bytes, scale = _quantize_groups(xg, rule)
    return _finish(x, q_bytes, scale)


# --------------------------------------------------------------------------------------------
# fast path: Triton (CUDA, sm_89+; mxfp8_triton.py) or torch.compile of the reference
# --------------------------------------------------------------------------------------------


def _quantize_groups_rceil(xg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize_groups(xg, "rceil")


def _quantize_groups_floor(xg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize_groups(xg, "floor")


@functools.cache
def _compiled_groups(rule: str):
    # One code object per rule and dynamic shapes keep recompiles to (dtype x device) per rule.
    fn = _quantize_groups_rceil if rule == "rceil" else _quantize_groups_floor
    return torch.compile(fn, dynamic=True)


def _quantize_compiled(x: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.compile'd reference (CPU, or GPUs without native fp8 conversion in Triton)."""
    if x.numel() == 0:
        return quantize_reference(x, rule)
    # detach(): a tensor with no view base, so dynamo does not guard on the caller's layout
    xg = x.contiguous().reshape(-1, BLOCK_SIZE).detach()
    q_bytes, scale = _compiled_groups(rule)(xg)
    return _finish(x, q_bytes, scale)


def _use_triton(x: torch.Tensor) -> bool:
    if x.device.type != "cuda" or not triton_available():
        return False
    if torch.version.hip is not None:
        return False  # float8e4nv lowering differs on ROCm; use the compiled reference
    return torch.cuda.get_device_capability(x.device) >= (8, 9)


def quantize_kernel(x: torch.Tensor, rule: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """Fast MXFP8 encoder, bit-identical to :func:`quantize_reference`.

    On CUDA sm_89+ with Triton: a Triton kernel (one program per ``groups`` x 32 elements).
    Elsewhere (CPU, older GPUs): ``torch.compile`` of the reference.
    """
    x = _prepare_input(x, rule)
    if _use_triton(x):
        return _quantize_triton(x, rule)
    return _quantize_compiled(x, rule)


def quantize(x: torch.Tensor, rule: str = "rceil") -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8-encode ``x`` along its last dimension -> ``(q float8_e4m3fn, scale uint8)``.

    CUDA tensors go through :func:`quantize_kernel`, others through
    :func:`quantize_reference`. Both give identical bytes.
    """
    if isinstance(x, torch.Tensor) and x.device.type == "cuda":
        return quantize_kernel(x, rule)
    return quantize_reference(x, rule)


# --------------------------------------------------------------------------------------------
# decode
# --------------------------------------------------------------------------------------------


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Decode ``q * 2**(scale - 127)`` to ``dtype``. Scale byte 255 decodes to NaN.

    Exact in float32 and bfloat16 (4 significant bits times a power of two in the fp32 exponent
    range, E8M0 byte 0 = 2**-127 included); float16 rounds/overflows as a normal cast does.
    """
    if q.dtype == torch.uint8:
        q = q.view(torch.float8_e4m3fn)
    if q.dtype != torch.float8_e4m3fn:
        raise TypeError(f"MXFP8 dequantize: q must be float8_e4m3fn, got {q.dtype}")
    if scale.dtype != torch.uint8:
        raise TypeError(f"MXFP8 dequantize: scale must be uint8 (E8M0), got {scale.dtype}")
    if q.dim() == 0 or tuple(scale.shape) != _scale_shape(q.shape) or q.shape[-1] % BLOCK_SIZE:
        raise ValueError(
            f"MXFP8 dequantize: shapes do not match: q {tuple(q.shape)}, scale {tuple(scale.shape)}"
            f" (expected scale {_scale_shape(q.shape) if q.dim() else '?'})"
        )
    s = scale.to(torch.int32)
    sf = (s << 23).view(torch.float32)  # 2**(s - 127) for s in 1..254
    sf = torch.where(s == 0, torch.full_like(sf, 2.0**-127), sf)
    sf = torch.where(s == SCALE_NAN, torch.full_like(sf, float("nan")), sf)
    qf = q.to(torch.float32).unflatten(-1, (q.shape[-1] // BLOCK_SIZE, BLOCK_SIZE))
    return (qf * sf.unsqueeze(-1)).flatten(-2).to(dtype)


# --------------------------------------------------------------------------------------------
# parameter selection
# --------------------------------------------------------------------------------------------

_ROUTER_GATE_RE = re.compile(r"(^|\.)(gate|shared_expert_gate)\.weight$")
_EMBED_KEYS = ("embed_tokens", "word_embeddings")
_LM_HEAD_KEYS = ("lm_head", "output_layer")


def should_quantize(
    name: str,
    tensor: torch.Tensor,
    *,
    quantize_embeddings: bool = False,
    quantize_lm_head: bool = False,
) -> bool:
    """Whether the parameter ``name`` is sent as MXFP8 (``True``) or kept in high precision.

    Kept in high precision: non-floating or already-fp8 tensors, tensors with fewer than 2 dims,
    last dim not a multiple of 32, norms (``"norm"`` in the name), biases (``.bias``),
    ``e_score_correction_bias``, router weights (``*.gate.weight`` such as ``mlp.gate.weight``,
    ``shared_expert_gate.weight``, anything containing ``"router"``), embeddings
    (``embed_tokens``/``word_embeddings``, unless ``quantize_embeddings``) and the LM head
    (``lm_head``/``output_layer``, unless ``quantize_lm_head``). ``gate_proj``/``up_proj``
    etc. are ordinary linears and are quantized.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.dtype not in (*_SUPPORTED_DTYPES, torch.float64):
        return False
    if tensor.dim() < 2 or tensor.shape[-1] % BLOCK_SIZE != 0 or tensor.numel() == 0:
        return False
    lname = name.lower()
    if "norm" in lname:
        return False
    if lname.endswith(".bias") or lname == "bias" or "e_score_correction_bias" in lname:
        return False
    if "router" in lname or _ROUTER_GATE_RE.search(lname):
        return False
    if any(k in lname for k in _EMBED_KEYS) and not quantize_embeddings:
        return False
    if any(k in lname for k in _LM_HEAD_KEYS) and not quantize_lm_head:
        return False
    return True
