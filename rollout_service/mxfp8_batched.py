"""MXFP8 expert processing in a few whole-layer kernels instead of a Python loop per expert (runs in the vLLM worker).

Why: an engine serving online MXFP8 re-quantizes every weight update (vLLM's layerwise reload runs
``process_weights_after_loading``). For a MoE layer vLLM quantizes expert by expert
(``Mxfp8OnlineMoEMethod._quantize_mxfp8_moe_weight``) and, on Hopper, repacks expert by expert for Marlin
(``prepare_mxfp8_moe_layer_for_marlin``: an fp8 pack, a transpose, a repack kernel and ~8 scale ops per expert). The
0.94 B demo model has 12 layers x 48 experts x 2 weights: ~30,000 small kernel launches per update, most of the MXFP8
update's time on an H100 (1.3-1.5 s against 0.05 s for a bf16 refit).

Both steps work row by row, so the experts can be processed as one matrix:

- quantize: MXFP8 takes one scale per 32 elements along the last dimension, so ``[E, N, K]`` quantized as
  ``[E*N, K]`` gives each expert's bytes exactly.
- Marlin: the repack and the scale permutation act on 16 x 64 tiles along the output dimension, so E experts of N
  outputs each, stacked into one "expert" of E*N outputs, repack to the experts' tiles side by side; a transpose puts
  them back in ``[E, ...]``. Only when the intermediate size needs no Marlin padding (the padding is per expert).

Nothing is assumed: the first call of each replacement in a process (and the first on arguments of new shapes) also
runs vLLM's own function and compares the results bit for bit (values and dtypes); the replacement is kept only if
they are equal, else vLLM's function serves from then on and a warning says why. ``set_enabled(False)`` restores
vLLM's functions (the refit benchmark measures both in one run).
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger(__name__)

_STATE: dict = {"enabled": True, "installed": False, "originals": {}, "verdicts": {}, "checked": set()}


def quantize_experts(quantize, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[E, N, K]`` -> (fp8 ``[E, N, K]``, uint8 scales ``[E, N, K/32]``) with one call of ``quantize`` (vLLM's
    ``mxfp8_e4m3_quantize``) on the experts stacked as rows."""
    experts, rows, cols = weight.shape
    q, scales = quantize(weight.reshape(experts * rows, cols), is_sf_swizzled_layout=False)
    return q.view(experts, rows, cols), scales.view(experts, rows, -1)


def repack_experts(weight: torch.Tensor) -> torch.Tensor:
    """Marlin repack of fp8 ``[E, N, K]`` (N outputs, K inputs per expert) with one repack kernel: the experts' rows
    stacked into one ``[E*N, K]`` matrix repack to their 16 x 64 tiles side by side, split back into
    ``[E, K/16, 4N]`` (int32), what vLLM's per-expert loop stacks."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp8 import pack_fp8_to_int32

    experts, outputs, inputs = weight.shape
    packed = pack_fp8_to_int32(weight.reshape(experts * outputs, inputs), size_k_first=False).T.contiguous()
    # vLLM 0.26 takes an (empty) act-order permutation; later versions dropped the argument.
    extra = {"perm": torch.empty(0, dtype=torch.int, device=weight.device)} if _repack_takes_perm(ops) else {}
    out = ops.gptq_marlin_repack(b_q_weight=packed, size_k=inputs, size_n=experts * outputs, num_bits=8, **extra)
    return out.view(out.shape[0], experts, -1).transpose(0, 1).contiguous()


@functools.cache
def _repack_takes_perm(ops) -> bool:
    """Read once per process: the repack runs twice per MoE layer on every update."""
    import inspect

    return "perm" in inspect.signature(ops.gptq_marlin_repack).parameters


def marlin_scales_experts(scales: torch.Tensor, outputs: int, inputs: int) -> torch.Tensor:
    """E8M0 scales ``[E, >=N, >=K/32]`` -> Marlin's ``[E, K/32, N]`` float8_e8m0fnu, as vLLM's per-expert loop makes
    them, in one pass: Marlin permutes scales in groups of 64 along the outputs, which never straddle two experts when
    N is a multiple of 64 (Marlin requires it)."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils import marlin_permute_scales
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp8 import mxfp8_marlin_process_scales

    experts = scales.shape[0]
    groups = inputs // 32
    rows = scales[:, :outputs, :groups].reshape(experts * outputs, groups)
    stacked = rows.view(torch.float8_e8m0fnu).to(torch.get_default_dtype()).T.contiguous()
    stacked = marlin_permute_scales(s=stacked, size_k=inputs, size_n=experts * outputs, group_size=32)
    stacked = mxfp8_marlin_process_scales(stacked)
    return stacked.view(groups, experts, outputs).transpose(0, 1).contiguous()


def prepare_marlin_experts(layer, w13, w2, w13_scale, w2_scale):
    """vLLM's ``prepare_mxfp8_moe_layer_for_marlin`` (no padding case) in four whole-layer passes."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils import marlin_make_workspace_new

    hidden, intermediate, w13_outputs = w13.shape[2], w2.shape[2], w13.shape[1]
    layer.workspace = marlin_make_workspace_new(w13.device, 4)  # the Marlin MoE kernel's scratch, as vLLM sets it
    return (
        repack_experts(w13),
        repack_experts(w2),
        marlin_scales_experts(w13_scale, w13_outputs, hidden),
        marlin_scales_experts(w2_scale, hidden, intermediate),
    )


def marlin_needs_padding(w2: torch.Tensor) -> bool:
    """Whether vLLM pads the intermediate size for Marlin (per expert: stacking would pad the wrong rows)."""
    from vllm.model_executor.layers.quantization.utils import marlin_utils_fp8

    padded = getattr(marlin_utils_fp8, "marlin_moe_padded_intermediate", None)
    return padded is None or padded(w2.shape[2], 32) != w2.shape[2]


def same_bytes(ours, theirs) -> str:
    """'' when two results (tensors or tuples of them) are equal bit for bit, else what differs."""
    ours = ours if isinstance(ours, tuple) else (ours,)
    theirs = theirs if isinstance(theirs, tuple) else (theirs,)
    if len(ours) != len(theirs):
        return f"{len(ours)} results against {len(theirs)}"
    for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"result {index}: {a.dtype}{tuple(a.shape)} against {b.dtype}{tuple(b.shape)}"
        if not torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)):
            return f"result {index}: bytes differ"
    return ""


def checked(name: str, batched, original):
    """Call ``batched`` in place of ``original`` once a call of both on arguments of the same shapes gave equal bytes
    (each new set of shapes is checked once); ``batched`` may return None to hand a call to ``original`` (a case it
    does not cover). One difference or failure hands every later call to ``original``."""

    def call(*args, **kwargs):
        verdict = _STATE["verdicts"].get(name)
        if not _STATE["enabled"] or (verdict is not None and verdict != "equal"):
            return original(*args, **kwargs)
        try:
            ours = batched(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - any failure hands this and later calls to vLLM's own function
            _STATE["verdicts"][name] = f"failed: {type(error).__name__}: {error}"
            log.warning("MXFP8 %s keeps vLLM's per-expert loop: the batched call failed (%s)", name, error)
            return original(*args, **kwargs)
        if ours is None:
            return original(*args, **kwargs)
        shapes = (name, *(tuple(a.shape) for a in args if isinstance(a, torch.Tensor)))
        if shapes not in _STATE["checked"]:
            theirs = original(*args, **kwargs)
            difference = same_bytes(ours, theirs)
            _STATE["verdicts"][name] = difference or "equal"
            if difference:
                log.warning("MXFP8 %s keeps vLLM's per-expert loop: the batched result differs (%s)", name, difference)
                return theirs
            _STATE["checked"].add(shapes)
            log.info(
                "MXFP8 %s: batched over experts (checked equal to vLLM's per-expert loop for %s)", name, shapes[1:]
            )
        return ours

    return call


def install() -> bool:
    """Patch vLLM's MXFP8 MoE quantize and Marlin preparation in this process; False when this vLLM has neither."""
    if _STATE["installed"]:
        return True
    try:
        from vllm.model_executor.layers.quantization.online import mxfp8 as online_mxfp8
        from vllm.model_executor.layers.quantization.utils import marlin_utils_fp8
    except ImportError:  # a vLLM without online MXFP8
        return False
    method = getattr(online_mxfp8, "Mxfp8OnlineMoEMethod", None)
    quantize = getattr(online_mxfp8, "mxfp8_e4m3_quantize", None)
    original_quantize = getattr(method, "_quantize_mxfp8_moe_weight", None)
    if original_quantize is None or quantize is None:  # another vLLM's layout of the method: leave it as it is
        return False
    original_prepare = getattr(marlin_utils_fp8, "prepare_mxfp8_moe_layer_for_marlin", None)

    def batched_quantize(self, weight):
        return quantize_experts(quantize, weight)

    method._quantize_mxfp8_moe_weight = checked("quantize", batched_quantize, original_quantize)
    _STATE["originals"]["quantize"] = (method, "_quantize_mxfp8_moe_weight", original_quantize)
    if original_prepare is not None:

        def batched_prepare(layer, w13, w2, w13_scale, w2_scale):
            if marlin_needs_padding(w2):
                return None
            return prepare_marlin_experts(layer, w13, w2, w13_scale, w2_scale)

        marlin_utils_fp8.prepare_mxfp8_moe_layer_for_marlin = checked("marlin", batched_prepare, original_prepare)
        _STATE["originals"]["marlin"] = (marlin_utils_fp8, "prepare_mxfp8_moe_layer_for_marlin", original_prepare)
    _STATE["installed"] = True
    return True


def set_enabled(enabled: bool) -> dict[str, str]:
    """Use the batched replacements (checked first) or vLLM's loops; returns each replacement's verdict so far."""
    _STATE["enabled"] = enabled
    return state()


def state() -> dict[str, str]:
    """Per replacement: 'equal', what differed, or 'unchecked'; plus whether batching is enabled."""
    verdicts = {name: _STATE["verdicts"].get(name, "unchecked") for name in _STATE["originals"]}
    verdicts["enabled"] = str(_STATE["enabled"])
    return verdicts
