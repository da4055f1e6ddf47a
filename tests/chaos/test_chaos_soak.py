"""The chaos soak: `fleetrl demo` (two vLLM servers, the trainer, the coordinator, valkey behind the fault proxy) under a
seeded schedule of SIGKILLs of each role, valkey restarts and connection cuts; the launcher restarts what dies.

After the run: every step done; every pushed group trained exactly once by the weights that survived (the last
checkpoint's ledger against the stream's pushed ids); every trained sample within the staleness bound (its token
versions against the version its step updated); no process of the run left; the summary's ``faults`` section counts
every fault injected and recovered, the restarts match the kills, and every fault was followed by a new step.

The CI size runs in ``make test``; ``FLEETRL_CHAOS_LONG=1`` runs the long soak too (seeds: ``FLEETRL_CHAOS_SEEDS``,
comma-separated). By hand: ``python -m tests.chaos.soak --seed N [--long]`` (docs/chaos.md).
"""

from __future__ import annotations

import os

import pytest

from modeling.tiny_model import init_tiny
from tests.chaos.schedule import KINDS
from tests.chaos.soak import CI_SIZE, LONG_SIZE, run_soak

pytestmark = [pytest.mark.e2e, pytest.mark.chaos]

CI_SEED = 1
LONG_SEEDS = [int(seed) for seed in os.environ.get("FLEETRL_CHAOS_SEEDS", "11,12,13").split(",")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(init_tiny(tmp_path_factory.mktemp("tiny")))


def assert_soak_passed(result, size, capsys) -> None:
    with capsys.disabled():  # the report rows, for docs/chaos.md
        print("\n" + "\n".join(result.rows))
    assert result.problems == [], "\n".join(result.problems)
    faults = result.summary["faults"]
    assert result.summary["steps"] == size.num_steps
    assert faults["injected"] == faults["recovered"] == {k: size.faults_per_kind.get(k, 0) for k in KINDS}
    assert faults["restarts"] == faults["expected_restarts"] == result.summary["restarts"]
    assert result.summary["max_staleness_seen"] <= result.summary["max_staleness_allowed"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("seed", [CI_SEED], ids=lambda seed: f"seed={seed}")
def test_a_run_under_seeded_faults_trains_every_group_once_within_the_bound_and_leaves_nothing(
    seed, model_dir, tmp_path, capsys
):
    assert_soak_passed(run_soak(tmp_path, model_dir, CI_SIZE, seed), CI_SIZE, capsys)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.skipif(os.environ.get("FLEETRL_CHAOS_LONG") != "1", reason="the long soak runs with FLEETRL_CHAOS_LONG=1")
@pytest.mark.parametrize("seed", LONG_SEEDS, ids=lambda seed: f"seed={seed}")
def test_the_long_soak_under_more_faults_and_steps(seed, model_dir, tmp_path, capsys):
    assert_soak_passed(run_soak(tmp_path, model_dir, LONG_SIZE, seed, finish_timeout_s=3000), LONG_SIZE, capsys)
