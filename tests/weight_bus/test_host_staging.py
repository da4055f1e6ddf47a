"""Pinned host staging (weight_bus.host_staging): device tensors copied into one reused host buffer.

The CUDA path (page-locked buffer, asynchronous copies) runs on a GPU only (scripts/gpu_check_sections.py,
``lora_adapter_sync``); here the layout the copies land in is checked with host tensors staged on purpose.
"""

from __future__ import annotations

import pytest
import torch

from weight_bus.host_staging import ALIGN_BYTES, PinnedHostStaging, copy_into, staging_nbytes

pytestmark = pytest.mark.unit


def adapter_like() -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        ("a.lora_A.weight", torch.randn(8, 64, generator=generator)),
        ("a.lora_B.weight", torch.randn(3, 8, generator=generator).to(torch.bfloat16)),  # 48 bytes: not aligned
        ("b.lora_B.weight", torch.randn(16, 8, generator=generator)[:, ::2]),  # not contiguous
    ]


def test_staged_tensors_are_aligned_views_of_one_buffer_equal_to_the_sources():
    named = adapter_like()
    every = lambda tensor: True  # noqa: E731 - stage host tensors as if they lay on a device
    nbytes = staging_nbytes(named, staged=every)
    assert nbytes == 2048 + ALIGN_BYTES + 256  # fp32 8 x 64; bf16 3 x 8 = 48 bytes, aligned up; fp32 16 x 4
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    staged = copy_into(buffer, named, non_blocking=False, staged=every)
    assert [name for name, _ in staged] == [name for name, _ in named]
    base = buffer.data_ptr()
    for (_, source), (_, view) in zip(named, staged, strict=True):
        assert torch.equal(view, source) and view.dtype == source.dtype and view.is_contiguous()
        assert base <= view.data_ptr() < base + nbytes and (view.data_ptr() - base) % ALIGN_BYTES == 0


def test_host_tensors_pass_through_untouched_and_allocate_nothing():
    named = adapter_like()
    staging = PinnedHostStaging()
    staged = staging.stage(iter(named))
    assert all(have is want for (_, have), (_, want) in zip(staged, named, strict=True))
    assert staging.buffer is None and staging_nbytes(named) == 0
