"""A step that trains nothing (every group stale, or a non-finite update) publishes nothing and is no step."""

from __future__ import annotations

import pytest
from synthetic import make_group

from modeling.tiny_model import init_tiny
from protos.config import TrainerConfig
from trainer_service.torch_backend import TorchBackend
from trainer_service.trainer import Trainer

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    return TorchBackend(str(init_tiny(tmp_path_factory.mktemp("tiny"))), TrainerConfig(geo_mask=None))


@pytest.fixture
def trainer(backend):
    return Trainer(backend, max_staleness=1, policy_version=11)


def test_a_step_whose_groups_are_all_stale_is_not_counted_and_keeps_the_version(trainer):
    """The H200 restart logged seven 'steps' in one second, each with every group dropped (staleness 11)."""
    values = trainer.step([make_group(0, version=0), make_group(1, version=0)])
    assert values["skipped"] == 1.0 and values["samples_step"] == 0.0
    assert trainer.policy_version == 11  # nothing to publish
    assert trainer.totals.steps == 0 and trainer.totals.steps_skipped == 1


def test_only_the_step_that_trains_counts_and_names_the_next_version(trainer):
    trainer.step([make_group(0, version=0)])  # every group stale
    values = trainer.step([make_group(2, version=11), make_group(3, version=10)])
    assert values["skipped"] == 0.0 and trainer.policy_version == 12
    assert trainer.totals.steps == 1 and trainer.totals.steps_skipped == 1
