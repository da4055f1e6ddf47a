"""The model matrix's checks end to end on one family (integration tier): scripts/model_matrix.py's own functions on a
real vLLM CPU engine, the torch trainer and megatron-bridge; the other families run in the script (docs/models.md)."""

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


def test_llama3_is_served_bridged_and_updated_with_logprobs_equal_to_the_trainers(matrix, tmp_path):
    model = str(init_family("llama3", tmp_path / "llama3"))
    results: dict = {}
    asyncio.run(matrix.engine_checks(model, results))
    matrix.bridge_check(model, results)
    assert {name: check["status"] for name, check in results.items()} == dict.fromkeys(matrix.CHECKS, "pass"), results
    assert results["bridge"]["detail"].endswith("tensors exact")


def test_the_table_has_one_row_per_family_and_a_cell_per_check_with_its_reason(matrix):
    rows = [
        {"family": "a", **{name: {"status": "pass", "detail": "ok"} for name in matrix.CHECKS}},
        {"family": "b", **{name: {"status": "fail", "detail": "ValueError: x | y"} for name in matrix.CHECKS}},
    ]
    table = matrix.render(rows, "cmd", "here").splitlines()
    assert "| a | pass: ok | pass: ok | pass: ok | pass: ok |" in table
    assert "| b | " + " | ".join(["fail: ValueError: x \\| y"] * 4) + " |" in table  # a bare pipe would split the cell
