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
    assert results["bridge"]["detail"].startswith("21/21 tensors exact; log-probs vs HF")


def test_the_table_has_one_row_per_family_and_a_cell_per_check_with_its_reason(matrix):
    rows = [
        {"family": "a", **{name: {"status": "pass", "detail": "ok"} for name in matrix.CHECKS}},
        {"family": "b", **{name: {"status": "fail", "detail": "ValueError: x | y"} for name in matrix.CHECKS}},
    ]
    table = matrix.render(rows, "cmd", "here").splitlines()
    assert "| a | pass: ok | pass: ok | pass: ok | pass: ok |" in table
    assert "| b | " + " | ".join(["fail: ValueError: x \\| y"] * 4) + " |" in table  # a bare pipe would split the cell


# What each family brings to the Megatron backend on CPU: DeepSeek-V3 MLA's core attention, a dense first layer
# before MoE ones, grouped experts under the bridge's grouped-GEMM names, the shared-expert overlap (off with the
# allgather dispatcher) and MTP heads (dropped); Nemotron zero-centred (1 + w) norms; gpt-oss attention sinks
# (megatron-core's own attention in place of the fused one), a sliding window and biased per-expert MLPs.
@pytest.mark.parametrize("family", ["deepseek_v3", "nemotron", "gpt_oss"])
def test_the_megatron_backend_imports_exports_and_computes_hfs_logprobs_for(family, matrix, tmp_path):
    model = str(init_family(family, tmp_path / family))
    results: dict = {}
    matrix.bridge_check(model, results)
    assert results["bridge"]["status"] == "pass", results
    exact, logprobs = results["bridge"]["detail"].split("; ")
    assert exact.endswith("tensors exact") and float(logprobs.split()[-1]) <= matrix.TOLERANCE


@pytest.mark.parametrize(
    ("family", "refusal"),
    [
        ("nemotron_h", "hybrid Mamba model.*Transformer Engine.*mamba-ssm.*trainer.backend=torch"),
        ("qwen3_next", "gated-DeltaNet.*Transformer Engine.*trainer.backend=torch"),
    ],
)
def test_a_family_megatron_core_builds_only_with_te_is_refused_naming_what_it_needs(family, refusal, tmp_path):
    from protos.config import TrainerConfig
    from trainer_service.megatron.backend import MegatronBackend

    model = str(init_family(family, tmp_path / family))
    with pytest.raises(ValueError, match=refusal):
        MegatronBackend(model, TrainerConfig(backend="megatron"))
