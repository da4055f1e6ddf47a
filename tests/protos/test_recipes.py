"""Every recipe in the repo is a valid run config (the schema is strict: a stale key fails here, not at launch)."""

from __future__ import annotations

from pathlib import Path

import pytest

from protos.config import load_run_config

pytestmark = pytest.mark.unit

RECIPES = sorted(Path(__file__).resolve().parents[2].glob("recipes/**/*.yaml"))


def test_recipes_are_found():
    assert len(RECIPES) >= 5


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_recipe_validates_against_the_run_config_schema(recipe):
    config = load_run_config(recipe)
    assert config.run_id and config.trainer.num_steps > 0
