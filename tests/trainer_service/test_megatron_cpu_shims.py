"""The CPU shims for Megatron come off again: ``undo()`` leaves torch.cuda and megatron-core as they were, and a
later ``apply()`` installs them again (tests/conftest.py undoes them after every module)."""

from __future__ import annotations

import pytest
import torch

from trainer_service.megatron import cpu_shims

pytestmark = pytest.mark.integration  # imports megatron-core

PATCHED_CUDA = ("current_device", "Stream", "current_stream", "stream")


def test_undo_restores_torch_cuda_and_the_rng_tracker_and_apply_patches_them_again():
    cpu_shims.undo()  # whatever an earlier test of this module left
    originals = {name: getattr(torch.cuda, name) for name in PATCHED_CUDA}
    cpu_shims.apply()
    from megatron.core.tensor_parallel import random as mp_random

    try:
        if not cpu_shims.cuda_absent():  # with CUDA the shims patch nothing
            assert not cpu_shims.applied()
            return
        assert cpu_shims.applied() and torch.cuda.current_device() == "cpu"
        patched_add = mp_random.CudaRNGStatesTracker.add
    finally:
        cpu_shims.undo()
    assert not cpu_shims.applied()
    assert all(getattr(torch.cuda, name) is original for name, original in originals.items())
    assert mp_random.CudaRNGStatesTracker.add is not patched_add
    cpu_shims.apply()
    assert torch.cuda.current_device() == "cpu" and mp_random.CudaRNGStatesTracker.add is patched_add
    cpu_shims.undo()
