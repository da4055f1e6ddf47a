"""Eval metric labels come from the dataset, not the file name: a configured label, else the rows' data_source,
else the file stem. The guide's naming: AIME 2025 as eval/aime-2025/*, AIME 2024 under the label math_dapo."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.evaluation import eval_label, load_eval_sets
from coordinator.tasks import PromptRenderer, load_problems
from modeling.tiny_model import build_tokenizer
from protos.config import load_run_config

pytestmark = pytest.mark.unit

BEAM = Path(__file__).resolve().parents[2] / "recipes" / "beam"


def test_label_is_the_configured_one_else_the_rows_data_source_else_the_file_stem(shared_data):
    config = load_run_config().coordinator
    parquet = str(shared_data / "aime-2024.parquet")  # verl schema, data_source 'aime24' on every row
    jsonl = str(shared_data / "aime-2025.jsonl")  # plain schema, no data_source
    assert eval_label(parquet, load_problems(parquet, config, 3), {}) == "aime24"
    assert eval_label(jsonl, load_problems(jsonl, config, 3), {}) == "aime-2025"
    assert eval_label(parquet, load_problems(parquet, config, 3), {parquet: "math_dapo"}) == "math_dapo"


def test_the_beam_recipes_eval_sets_carry_the_guides_labels(shared_data):  # the recipes read ../shared/data
    config = load_run_config([BEAM / "dapo-mxfp8.yaml", BEAM / "toy.yaml"]).with_dataset_paths()
    renderer = PromptRenderer(build_tokenizer(), config.coordinator.template_kwargs())
    sets = load_eval_sets(config.coordinator, renderer, config.rollout.max_model_len)
    assert [eval_set.name for eval_set in sets] == ["math_dapo", "aime-2025"]
    assert [len(eval_set.problems) for eval_set in sets] == [2, 2]
