"""Trainer core on recorded groups (no vLLM): staleness bound, version advance, NaN skip."""

from __future__ import annotations

import numpy as np
import pytest

from modeling.tiny_model import init_tiny
from protos.config import TrainerConfig
from protos.records import Array, FinishReason, Sample, TrajectoryGroup, VersionSpan
from trainer_service.torch_backend import TorchBackend
from trainer_service.trainer import Trainer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(init_tiny(tmp_path_factory.mktemp("tiny")))


def _group(index: int, version: int, rewards=(0.0, 1.0)) -> TrajectoryGroup:
    samples = [
        Sample(Array.from_numpy(np.array([5, 6, 7], np.int32)), Array.from_numpy(np.full(3, -4.0, np.float32)),
               [VersionSpan(version, 0, 3)], FinishReason.LENGTH, reward)
        for reward in rewards
    ]
    return TrajectoryGroup(f"g{index}", f"p{index}", Array.from_numpy(np.array([1, 4, 5], np.int32)),
                           samples, "test", index, version, 0.0)


def test_trainer_drops_groups_beyond_staleness_bound_and_counts_them(model_dir):
    trainer = Trainer(TorchBackend(model_dir, TrainerConfig(geo_mask=None)), max_staleness=1, policy_version=3)
    values = trainer.step([_group(0, 3), _group(1, 2), _group(2, 1)])  # staleness 0, 1, 2
    assert values["staleness_max"] == 2.0
    assert trainer.totals.stale_dropped == 2  # the two samples of the group at staleness 2
    assert trainer.totals.samples_trained == 4
    assert trainer.policy_version == 4 and values["skipped"] == 0.0
    assert trainer.totals.staleness_counts == {0: 1, 1: 1, 2: 1}


def test_trainer_does_not_advance_version_when_every_group_is_stale(model_dir):
    trainer = Trainer(TorchBackend(model_dir, TrainerConfig()), max_staleness=0, policy_version=5)
    values = trainer.step([_group(0, 3)])
    assert values["skipped"] == 1.0 and trainer.policy_version == 5
    assert trainer.totals.stale_dropped == 2 and trainer.totals.samples_trained == 0


def test_non_finite_loss_skips_the_step_and_keeps_weights(model_dir):
    backend = TorchBackend(model_dir, TrainerConfig(geo_mask=None))
    trainer = Trainer(backend, max_staleness=1, policy_version=0)
    before = {k: v.clone() for k, v in backend.model.state_dict().items()}
    values = trainer.step([_group(0, 0, rewards=(float("nan"), 1.0))])
    assert values["skipped"] == 1.0 and trainer.policy_version == 0
    assert all((before[k] == v).all() for k, v in backend.model.state_dict().items())
