"""Pack named tensors into fixed-size buckets described by a manifest, and read them back.

A tensor is stored as its raw bytes at a 64-byte aligned offset in one bucket; one larger than the
bucket size gets a bucket of its own. The manifest carries a crc32 per tensor so a receiver can refuse
a corrupted transfer before anything reaches the engine.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterable, Iterator

import torch

from protos.records import TensorEntry, WeightManifest

ALIGN_BYTES = 64


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
    return memoryview(flat.numpy())


def _align(offset: int) -> int:
    return (offset + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def pack(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    version: int,
    bytes_per_bucket: int,
    publisher_address: str = "",
    transport: str = "tcp",
) -> tuple[WeightManifest, list[bytearray]]:
    """Copy CPU tensors into buckets; returns the manifest and the bucket buffers."""
    entries: list[TensorEntry] = []
    placed: list[tuple[int, int, memoryview]] = []  # (bucket, offset, bytes)
    bucket_sizes: list[int] = [0]
    for name, tensor in named_tensors:
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        data = _tensor_bytes(tensor)
        nbytes = data.nbytes
        offset = _align(bucket_sizes[-1])
        if bucket_sizes[-1] > 0 and offset + nbytes > bytes_per_bucket:
            bucket_sizes.append(0)
            offset = 0
        bucket = len(bucket_sizes) - 1
        bucket_sizes[bucket] = offset + nbytes
        placed.append((bucket, offset, data))
        entries.append(
            TensorEntry(
                name=name,
                dtype=str(tensor.dtype).removeprefix("torch."),
                shape=tuple(tensor.shape),
                codec="raw",
                bucket=bucket,
                offset=offset,
                nbytes=nbytes,
                checksum=zlib.crc32(data),
            )
        )
    # Pad every bucket to the alignment so tensors stay aligned when buckets are laid end to end.
    bucket_sizes = [_align(size) for size in bucket_sizes]
    buckets = [bytearray(size) for size in bucket_sizes]
    for bucket, offset, data in placed:
        buckets[bucket][offset : offset + data.nbytes] = data
    manifest = WeightManifest(
        version=version,
        tensors=entries,
        bucket_nbytes=bucket_sizes,
        publisher_address=publisher_address,
        transport=transport,
        created_s=time.time(),
    )
    return manifest, buckets


def bucket_offsets(manifest: WeightManifest) -> list[int]:
    """Start of each bucket when all buckets are laid end to end in one buffer."""
    offsets, total = [], 0
    for size in manifest.bucket_nbytes:
        offsets.append(total)
        total += size
    return offsets


def total_nbytes(manifest: WeightManifest) -> int:
    return sum(manifest.bucket_nbytes)


class ChecksumError(ValueError):
    """A received tensor's bytes do not match the manifest's crc32."""


def verify(manifest: WeightManifest, buffer: memoryview) -> None:
    """Raise ChecksumError naming the first tensor whose bytes differ from the manifest."""
    starts = bucket_offsets(manifest)
    for entry in manifest.tensors:
        begin = starts[entry.bucket] + entry.offset
        if zlib.crc32(buffer[begin : begin + entry.nbytes]) != entry.checksum:
            raise ChecksumError(
                f"weights v{manifest.version}: tensor {entry.name} (bucket {entry.bucket}) "
                "failed its checksum; the transfer is refused"
            )


def iter_tensors(manifest: WeightManifest, buffer: memoryview) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) views into ``buffer`` (all buckets end to end) in manifest order."""
    starts = bucket_offsets(manifest)
    for entry in manifest.tensors:
        begin = starts[entry.bucket] + entry.offset
        if entry.nbytes == 0:  # torch.frombuffer refuses empty buffers
            yield entry.name, torch.empty(entry.shape, dtype=getattr(torch, entry.dtype))
            continue
        raw = torch.frombuffer(buffer[begin : begin + entry.nbytes], dtype=torch.uint8)
        yield entry.name, raw.view(getattr(torch, entry.dtype)).reshape(entry.shape)
