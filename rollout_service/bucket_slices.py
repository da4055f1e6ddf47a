"""Where a refit plan's copies come from: strided views of a version's buckets (uint8 tensors, one per manifest
bucket), found once when a plan is recorded and bound anew to each later version's buckets. Shared by the copy plan
(rollout_service/refit_plan.py) and the layer plan (rollout_service/layer_plan.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


class PlanRefused(Exception):
    """The loaders did something a plan cannot replay; the message says what."""


@dataclass(frozen=True)
class BucketSlice:
    """Where a copy's source lies: a strided view of bucket ``bucket`` read as ``dtype``."""

    bucket: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    element_offset: int  # from the bucket's first byte, in elements of ``dtype``


def bucket_views(slices, buckets: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``buckets`` for ``slices`` (anything with BucketSlice's fields: SliceCopy too), in order."""
    typed: dict[tuple[int, torch.dtype], torch.Tensor] = {}
    views = []
    for piece in slices:
        base = typed.get((piece.bucket, piece.dtype))
        if base is None:
            base = typed[(piece.bucket, piece.dtype)] = _typed(buckets[piece.bucket], piece.dtype)
        views.append(base.as_strided(piece.shape, piece.stride, base.storage_offset() + piece.element_offset))
    return views


def locate(source: torch.Tensor, buckets: list[torch.Tensor], what: str) -> BucketSlice | None:
    """``source`` as a slice of one of ``buckets``, or None when it lies in none of them."""
    pointer = source.data_ptr()
    for index, bucket in enumerate(buckets):
        start = bucket.data_ptr()
        if start <= pointer < start + bucket.numel() and source.untyped_storage().data_ptr() == (
            bucket.untyped_storage().data_ptr()
        ):
            offset_bytes = pointer - start
            if offset_bytes % source.element_size():
                raise PlanRefused(f"a copy into {what} from a misaligned slice")
            shape, stride = tuple(source.shape), tuple(source.stride())
            return BucketSlice(index, source.dtype, shape, stride, offset_bytes // source.element_size())
    return None


def _typed(bucket: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    usable = bucket.numel() // dtype.itemsize * dtype.itemsize
    return bucket[:usable].view(dtype)
