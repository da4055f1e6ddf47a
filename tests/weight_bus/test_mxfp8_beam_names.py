"""The MXFP8 Beam run's weight sync keeps norms and the router at their precision (the launch guide): on the tiny
Beam's HF tensors, only the attention and MLP projections are quantized."""

from __future__ import annotations

import pytest
import torch

from modeling.beam.tiny import init_tiny_beam
from weight_bus.codecs.mxfp8 import should_quantize

pytestmark = pytest.mark.unit


def test_only_beams_linear_projections_travel_as_mxfp8(tmp_path):
    from safetensors.torch import load_file

    state = load_file(str(init_tiny_beam(tmp_path) / "model.safetensors"))
    quantized = {name for name, tensor in state.items() if should_quantize(name, tensor.to(torch.bfloat16))}
    kept = set(state) - quantized
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert quantized and all(name.endswith(".weight") and name.split(".")[-2] in projections for name in quantized)
    assert any(name.endswith("mlp.gate.weight") for name in kept)  # the router
    assert any(name.endswith("e_score_correction_bias") for name in kept)
    assert all(name in kept for name in state if "norm" in name)
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= kept
