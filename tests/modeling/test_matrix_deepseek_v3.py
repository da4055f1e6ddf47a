"""DeepSeek-V3 through the model matrix's engine checks (integration tier): a tiny DeepSeek-V3 (MLA, a dense first
layer, shared expert, grouped sigmoid routing with ``e_score_correction_bias``) serves on vLLM's CPU engine with the
torch trainer's log-probs, and a perturbed trainer's weights committed into it are served exactly. One engine."""

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


def test_deepseek_v3_serves_and_takes_a_weight_update_with_the_trainers_logprobs(matrix, tmp_path):
    model = str(init_family("deepseek_v3", tmp_path / "deepseek_v3"))
    results: dict = {}
    asyncio.run(matrix.engine_checks(model, results))
    assert {name: check["status"] for name, check in results.items()} == {
        "serve": "pass",
        "logprobs": "pass",
        "update": "pass",
    }, results
