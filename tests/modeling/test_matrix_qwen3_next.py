"""Qwen3-Next through the model matrix's engine checks (integration tier): vLLM's CPU engine runs its gated-DeltaNet
layers only in bf16, so the tiny Qwen3-Next serves in bf16 against the fp32 torch trainer, and a perturbed trainer's
weights committed into it are served (the bf16 tolerance). One engine."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest

from modeling.families import init_family

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "model_matrix.py"


@pytest.fixture(scope="module")
def matrix():
    spec = importlib.util.spec_from_file_location("model_matrix", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_qwen3_next_serves_in_bf16_and_takes_a_weight_update_with_the_trainers_logprobs(matrix, tmp_path):
    model = str(init_family("qwen3_next", tmp_path / "qwen3_next"))
    results: dict = {}
    asyncio.run(matrix.engine_checks(model, results))
    assert {name: check["status"] for name, check in results.items()} == {
        "serve": "pass",
        "logprobs": "pass",
        "update": "pass",
    }, results
    assert "engine bfloat16" in results["update"]["detail"]
