"""Pack named tensors into fixed-size buckets described by a manifest, and read them back.

A tensor is stored as its raw bytes at a 64-byte aligned offset in one bucket; one larger than the
bucket size gets a bucket of its own. The manifest carries a crc32 per tensor so a receiver can refuse
a corrupted transfer before anything reaches the engine.

Wire codecs: ``bf16`` is pass-through (each tensor travels in its own dtype, entry codec ``raw``).
``mxfp8`` sends each eligible 2-D weight (see ``codecs.mxfp8.should_quantize``) as an entry with codec
``mxfp8`` (float8_e4m3fn payload) followed by its companion ``<name>_scale`` (uint8 E8M0, codec ``raw``).
Everything else keeps its dtype, so fp32 router biases stay fp32.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import msgspec
import numpy as np
import torch

from protos.records import LoraAdapter, TensorEntry, WeightManifest
from weight_bus import checksums
from weight_bus.codecs import mxfp8

ALIGN_BYTES = 64
SCALE_SUFFIX = "_scale"


@dataclass(frozen=True)
class WireCodec:
    """How tensors are encoded on the wire; built from ``WeightBusConfig`` by ``from_config``."""

    name: str = "bf16"  # "bf16" (pass-through) | "mxfp8"
    rule: str = "rceil"
    quantize_embeddings: bool = False
    quantize_lm_head: bool = False

    @classmethod
    def from_config(cls, config) -> WireCodec:
        return cls(config.codec, config.mxfp8_rule, config.quantize_embeddings, config.quantize_lm_head)

    def quantizes(self, name: str, tensor: torch.Tensor) -> bool:
        return self.name == "mxfp8" and mxfp8.should_quantize(
            name, tensor, quantize_embeddings=self.quantize_embeddings, quantize_lm_head=self.quantize_lm_head
        )


RAW = WireCodec()


@dataclass
class PackedBucket:
    """One filled bucket: its index, its bytes and the entries it holds (with checksums)."""

    index: int
    data: np.ndarray  # uint8, length a multiple of ALIGN_BYTES
    entries: list[TensorEntry] = field(default_factory=list)


def _align(offset: int) -> int:
    return (offset + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes in logical order as a flat uint8 tensor where it lies (a view when already contiguous).

    A device tensor stays on its device: ``_fill`` copies it straight into the host bucket (pinned on a GPU machine),
    instead of a blocking ``.cpu()`` into fresh pageable memory and a second copy into the bucket.
    """
    return tensor.detach().contiguous().view(-1).view(torch.uint8)


def encode_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]], codec: WireCodec = RAW
) -> Iterator[tuple[str, torch.Tensor, str]]:
    """Yield (entry name, payload tensor, entry codec); an MXFP8 weight yields its pair, scale second.

    Quantization runs where the tensor lies (the Triton kernel on CUDA), before any copy to the host.
    """
    for name, tensor in named_tensors:
        if codec.quantizes(name, tensor):
            q, scale = mxfp8.quantize(tensor.detach(), codec.rule)
            yield name, q, "mxfp8"
            yield name + SCALE_SUFFIX, scale, "raw"
        else:
            yield name, tensor, "raw"


class _Placer:
    """Greedy placement: next aligned offset in the current bucket, or a new bucket when it would overflow."""

    def __init__(self, bytes_per_bucket: int):
        self.bytes_per_bucket = bytes_per_bucket
        self.bucket = 0
        self.used = 0

    def place(self, nbytes: int) -> tuple[int, int]:
        offset = _align(self.used)
        if self.used > 0 and offset + nbytes > self.bytes_per_bucket:
            self.bucket, offset = self.bucket + 1, 0
        self.used = offset + nbytes
        return self.bucket, offset


def plan_layout(
    metas: Iterable[tuple[str, str, tuple[int, ...], str, int]], bytes_per_bucket: int
) -> tuple[list[TensorEntry], list[int]]:
    """Lay out entries from metadata only: (name, dtype, shape, codec, nbytes) -> entries + bucket sizes.

    Gives the same layout as ``iter_buckets`` (checksums 0); a broadcast transport uses it to tell
    receivers the bucket sizes before any byte is packed.
    """
    placer, entries, sizes = _Placer(bytes_per_bucket), [], [0]
    for name, dtype, shape, codec, nbytes in metas:
        bucket, offset = placer.place(nbytes)
        if bucket == len(sizes):
            sizes.append(0)
        sizes[bucket] = offset + nbytes
        entries.append(TensorEntry(name, dtype, tuple(shape), codec, bucket, offset, nbytes, 0))
    return entries, [_align(size) for size in sizes]


def encoded_metas(
    named_tensors: Iterable[tuple[str, torch.Tensor]], codec: WireCodec = RAW
) -> Iterator[tuple[str, str, tuple[int, ...], str, int]]:
    """Metadata of what ``encode_tensors`` would yield, without quantizing or copying anything."""
    for name, tensor in named_tensors:
        shape = tuple(tensor.shape)
        if codec.quantizes(name, tensor):
            scale_shape = shape[:-1] + (shape[-1] // mxfp8.BLOCK_SIZE,)
            yield name, "float8_e4m3fn", shape, "mxfp8", tensor.numel()
            yield name + SCALE_SUFFIX, "uint8", scale_shape, "raw", tensor.numel() // mxfp8.BLOCK_SIZE
        else:
            yield name, _dtype_name(tensor.dtype), shape, "raw", tensor.numel() * tensor.element_size()


def _new_buffer(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, dtype=np.uint8)  # no zero fill: _fill zeroes only the gaps


def _fill(index: int, pending: list[tuple[TensorEntry, torch.Tensor]], used: int, alloc) -> PackedBucket:
    """Copy the pending payloads into a bucket, then checksum them there (in parallel, from the host bytes)."""
    data = alloc(_align(used))
    target = torch.from_numpy(data)
    cursor, on_device = 0, False
    for entry, payload in pending:
        data[cursor : entry.offset] = 0
        if entry.nbytes:
            on_device |= payload.device.type == "cuda"
            target[entry.offset : entry.offset + entry.nbytes].copy_(payload, non_blocking=payload.is_cuda)
        cursor = entry.offset + entry.nbytes
    data[cursor:] = 0  # padding is deterministic, so snapshots and buckets of equal weights are equal
    if on_device:
        torch.cuda.synchronize()  # every device-to-host copy has landed before the bytes are checksummed
    crcs = checksums.crc32_many([data[e.offset : e.offset + e.nbytes] for e, _ in pending])
    entries = [msgspec.structs.replace(e, checksum=crc) for (e, _), crc in zip(pending, crcs, strict=True)]
    return PackedBucket(index, data, entries)


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bytes_per_bucket: int,
    codec: WireCodec = RAW,
    alloc: Callable[[int], np.ndarray] = _new_buffer,
) -> Iterator[PackedBucket]:
    """Encode and pack tensors bucket by bucket; only one bucket's host bytes are alive at a time.

    ``alloc(nbytes)`` gives each bucket's uint8 buffer (a publisher recycles old ones). Always yields
    at least one bucket (possibly empty), as receivers expect. Device tensors are copied straight into
    the bucket (asynchronously, one synchronize per bucket).
    """
    placer = _Placer(bytes_per_bucket)
    pending: list[tuple[TensorEntry, torch.Tensor]] = []
    for name, payload, entry_codec in encode_tensors(named_tensors, codec):
        data = _flat_bytes(payload)
        previous_bucket, previous_used = placer.bucket, placer.used
        bucket, offset = placer.place(data.numel())
        if bucket != previous_bucket:
            yield _fill(previous_bucket, pending, previous_used, alloc)
            pending = []
        shape = tuple(payload.shape)
        entry = TensorEntry(name, _dtype_name(payload.dtype), shape, entry_codec, bucket, offset, data.numel(), 0)
        pending.append((entry, data))  # the checksum is set by _fill, from the bucket's bytes
    yield _fill(placer.bucket, pending, placer.used, alloc)


def make_manifest(
    version: int,
    buckets: list[PackedBucket],
    publisher_address: str = "",
    transport: str = "tcp",
    adapter: LoraAdapter | None = None,
) -> WeightManifest:
    """The manifest of packed ``buckets``; ``adapter`` says they hold a LoRA adapter, not weights."""
    return WeightManifest(
        version=version,
        tensors=[entry for bucket in buckets for entry in bucket.entries],
        bucket_nbytes=[len(bucket.data) for bucket in buckets],
        publisher_address=publisher_address,
        transport=transport,
        created_s=time.time(),
        adapter=adapter,
    )


def pack(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    version: int,
    bytes_per_bucket: int,
    publisher_address: str = "",
    transport: str = "tcp",
    codec: WireCodec = RAW,
    adapter: LoraAdapter | None = None,
) -> tuple[WeightManifest, list[np.ndarray]]:
    """Encode and copy tensors into buckets; returns the manifest and the bucket buffers (uint8)."""
    buckets = list(iter_buckets(named_tensors, bytes_per_bucket, codec))
    return make_manifest(version, buckets, publisher_address, transport, adapter), [b.data for b in buckets]


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


def verify(manifest: WeightManifest, buffer: memoryview, bucket: int | None = None) -> None:
    """Raise ChecksumError naming the first tensor (of ``bucket``, or all) whose bytes differ.

    The crcs run on the shared checksum pool, so a large version is verified at several cores' speed.
    """
    starts = bucket_offsets(manifest)
    entries = [entry for entry in manifest.tensors if bucket is None or entry.bucket == bucket]
    views = []
    try:
        for entry in entries:
            begin = starts[entry.bucket] + entry.offset
            views.append(buffer[begin : begin + entry.nbytes])
        crcs = checksums.crc32_many(views)
    finally:
        # Release the slices now: a ChecksumError's traceback keeps this frame alive, and a slice still exported
        # from the caller's mapped staging file would make closing it fail (BufferError) instead of the refusal.
        for view in views:
            view.release()
        del views
    for entry, crc in zip(entries, crcs, strict=True):
        if crc != entry.checksum:
            raise ChecksumError(
                f"weights v{manifest.version}: tensor {entry.name} (bucket {entry.bucket}) "
                "failed its checksum; the transfer is refused"
            )


def entry_dtype(entry: TensorEntry) -> torch.dtype:
    dtype = getattr(torch, entry.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"tensor {entry.name}: unknown dtype {entry.dtype!r} in the manifest")
    return dtype


def _view(entry: TensorEntry, buffer: memoryview, start: int) -> torch.Tensor:
    dtype = entry_dtype(entry)
    if entry.nbytes == 0:  # torch.frombuffer refuses empty buffers
        return torch.empty(entry.shape, dtype=dtype)
    begin = start + entry.offset
    raw = torch.frombuffer(buffer[begin : begin + entry.nbytes], dtype=torch.uint8)
    return raw.view(dtype).reshape(entry.shape)


def _companion_of(name: str) -> str | None:
    return name[: -len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else None


def iter_tensors(
    manifest: WeightManifest, buffer: memoryview, dequantize_to: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) views into ``buffer`` (all buckets end to end) in manifest order.

    ``dequantize_to=None`` yields MXFP8 pairs as they are (``name`` float8_e4m3fn, ``name_scale``
    uint8: vLLM's checkpoint format). With a dtype, each pair becomes one tensor ``name`` of that dtype
    (``mxfp8.dequantize``, exact in float32 and bfloat16); raw entries keep their own dtype.
    """
    starts = bucket_offsets(manifest)
    return iter_entries(manifest, lambda entry: _view(entry, buffer, starts[entry.bucket]), dequantize_to)


def iter_entries(
    manifest: WeightManifest, view: Callable[[TensorEntry], torch.Tensor], dequantize_to: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``iter_tensors`` over any storage: ``view(entry)`` gives an entry's tensor (host map or device bucket)."""
    quantized = {e.name: e for e in manifest.tensors if e.codec == "mxfp8"}
    scales = {e.name: e for e in manifest.tensors if e.name.endswith(SCALE_SUFFIX)}
    for entry in manifest.tensors:
        if entry.codec not in ("raw", "mxfp8"):
            raise ValueError(f"tensor {entry.name}: unknown wire codec {entry.codec!r}")
        if dequantize_to is None or entry.codec == "raw":
            if dequantize_to is not None and _companion_of(entry.name) in quantized:
                continue  # consumed with its weight
            yield entry.name, view(entry)
            continue
        scale = scales.get(entry.name + SCALE_SUFFIX)
        if scale is None:
            raise ValueError(f"tensor {entry.name}: MXFP8 entry without its {entry.name}{SCALE_SUFFIX} companion")
        yield entry.name, mxfp8.dequantize(view(entry), view(scale), dequantize_to)
