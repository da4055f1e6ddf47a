"""Checks shared by the Megatron backend tests of several models (tests/ has no packages: import by name)."""

from __future__ import annotations

import torch

from trainer_service.megatron.backend import MegatronBackend


def assert_resume_is_bit_identical(model_dir: str, config, batch, tmp_path) -> None:
    """Save after one step, take two more; a fresh backend loaded from the save takes the same two exactly.

    Step 2 depends on the restored weights, step 3 on the restored Adam moments and step counters too.
    """
    continuing = MegatronBackend(model_dir, config)
    continuing.train_step(batch)
    continuing.save_checkpoint(tmp_path)
    batch.advantages_B.neg_()
    expected = [continuing.train_step(batch), continuing.train_step(batch)]

    resumed = MegatronBackend(model_dir, config)
    resumed.load_checkpoint(tmp_path)
    actual = [resumed.train_step(batch), resumed.train_step(batch)]

    for got, want in zip(actual, expected, strict=True):
        assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"]
    final = dict(continuing.export_hf_weights())
    assert all(torch.equal(final[name], tensor) for name, tensor in resumed.export_hf_weights())
