"""CUDA IPC transport of the weight bus: a trainer that shares its GPU with the rollout engine (colocated).

Publisher, per version: pack every bucket on the GPU into device memory (MXFP8 quantized there, as for NCCL) ->
the buckets' IPC handles into Redis (``RedisKeys.ipc_buckets``) -> the manifest (transport 'ipc', without
checksums: ``checksummed=False``), which announces the version. Off the trainer's path, a ``HostMirror`` thread
then copies the buckets to pinned host memory, checksums them, holds them on the tcp publisher (receivers that
cannot open the handles, disk snapshots) and replaces the stored manifest with the checksummed one; a tcp receiver
of an ipc version waits for that. Device buckets of the last ``IPC_KEEP_VERSIONS`` versions stay allocated; torch's
IPC reference counting keeps an allocation alive while a consumer still holds it open.

Receiver (inside the vLLM worker on the same GPU, ``open_version`` + ``iter_device_tensors``): every handle is
opened before anything is written, so a failure leaves the engine as it was and the caller takes the tcp path for
that version; then views of the device buckets go straight into the model (no staging file, no host copy).

Where IPC is impossible (no CUDA at the trainer, another GPU, the producer's own process) the bytes travel over
tcp as for ``transport=tcp``: the publisher degrades to ``WeightSender`` at start, a receiver per version.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator

import msgspec
import redis
import torch

from channels.version_board import VersionBoard
from protos.records import CudaIpcBucket, CudaIpcVersion, WeightManifest
from protos.redis_keys import RedisKeys
from weight_bus import nccl_group as ng
from weight_bus import packing
from weight_bus.nccl_device import ChunkPacker, FlatHost
from weight_bus.sender import PublishStats, WeightSender

logger = logging.getLogger(__name__)

IPC_KEEP_VERSIONS = 2  # device memory held by the trainer: the version being loaded and the one before it


class IpcUnavailable(RuntimeError):
    """A version's IPC buckets cannot be opened here; the version is received over tcp instead."""


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def share_bucket(bucket: torch.Tensor) -> CudaIpcBucket:
    """The IPC handle of one uint8 device bucket (torch's own sharing protocol, without pickle)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(bucket)
    (
        _cls,
        size,
        _stride,
        offset,
        _storage_cls,
        _dtype,
        _device,
        handle,
        storage_size_bytes,
        storage_offset_bytes,
        _requires_grad,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = args
    return CudaIpcBucket(
        int(size[0]),
        int(offset),
        bytes(handle),
        int(storage_size_bytes),
        int(storage_offset_bytes),
        bytes(ref_counter_handle),
        int(ref_counter_offset),
        bytes(event_handle or b""),
        bool(event_sync_required),
    )


def why_not_openable(record: CudaIpcVersion, device: torch.device) -> str:
    """'' when this process can open ``record``'s buckets on ``device``, else the reason it cannot."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return "no CUDA device here"
    if record.producer_pid == os.getpid():
        return "this is the producer's own process"
    here = device_uuid(device)
    if here != record.device_uuid:
        return f"the buckets are on GPU {record.device_uuid}, this process is on {here}"
    return ""


def open_version(record: CudaIpcVersion, device: torch.device) -> list[torch.Tensor]:
    """Open every bucket of ``record`` (uint8 device tensors); raises IpcUnavailable before returning any."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    reason = why_not_openable(record, device)
    if reason:
        raise IpcUnavailable(f"v{record.version}: {reason}")
    buckets = []
    try:
        for bucket in record.buckets:
            buckets.append(
                rebuild_cuda_tensor(
                    torch.Tensor,
                    (bucket.nbytes,),
                    (1,),
                    bucket.storage_offset,
                    torch.storage.TypedStorage,
                    torch.uint8,
                    device.index if device.index is not None else torch.cuda.current_device(),
                    bucket.handle,
                    bucket.storage_size_bytes,
                    bucket.storage_offset_bytes,
                    False,
                    bucket.ref_counter_handle,
                    bucket.ref_counter_offset,
                    bucket.event_handle or None,
                    bucket.event_sync_required,
                )
            )
    except RuntimeError as error:  # cudaIpcOpenMemHandle refused: the allocation is gone or not ours to map
        raise IpcUnavailable(f"v{record.version}: opening bucket {len(buckets)} failed: {error}") from error
    return buckets


def iter_device_tensors(
    manifest: WeightManifest, buckets: list[torch.Tensor], dequantize_to: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``packing.iter_tensors`` over device buckets: (name, tensor) views on the GPU, in manifest order."""
    return packing.iter_entries(manifest, lambda entry: _device_view(entry, buckets[entry.bucket]), dequantize_to)


def _device_view(entry, bucket: torch.Tensor) -> torch.Tensor:
    dtype = packing.entry_dtype(entry)
    return bucket[entry.offset : entry.offset + entry.nbytes].view(dtype).reshape(entry.shape)


class IpcWeightPublisher:
    """Trainer side of transport 'ipc'; the interface of ``WeightSender`` (``publish``, ``close``, ``tcp``)."""

    def __init__(self, client: redis.Redis, keys: RedisKeys, config, device: torch.device | None = None):
        self.client, self.keys, self.config = client, keys, config
        self.board = VersionBoard(client, keys)
        # Its pinned host buffers are recycled once a version is dropped and no receiver reads it (HostMirror).
        self.fallback = WeightSender(client, keys, config, transport="ipc", pinned=True)
        self.tcp = self.fallback.tcp
        self.codec = self.fallback.codec
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        self.uuid = device_uuid(self.device)
        self.held: dict[int, list[torch.Tensor]] = {}  # version -> its device buckets
        self.mirror = HostMirror(self.fallback, self.device)
        self.last_parts: dict[str, float] = {}  # seconds of the last publish's parts (benchmarks, logs)

    def publish(self, version: int, named_tensors) -> PublishStats:
        self.mirror.raise_failure()  # a host copy that failed stops the trainer here, not silently
        started = time.monotonic()
        named = list(named_tensors)  # the export (a collective under Megatron) runs here
        exported = time.monotonic()
        entries, sizes = packing.plan_layout(packing.encoded_metas(named, self.codec), self.fallback.bytes_per_bucket)
        buckets = [torch.empty(size, dtype=torch.uint8, device=self.device) for size in sizes]
        packer = ChunkPacker(named, self.codec, entries, self.device)
        offset = 0
        for index, (size, bucket) in enumerate(zip(sizes, buckets, strict=True)):
            packer.pack(ng.Chunk(index, 0, size, offset), bucket)
            offset += size
        del named, packer  # the buckets hold the bytes now
        torch.cuda.current_stream(self.device).synchronize()
        packed = time.monotonic()
        manifest = WeightManifest(version, entries, sizes, self.tcp.address, "ipc", time.time(), checksummed=False)
        record = CudaIpcVersion(version, self.uuid, os.getpid(), [share_bucket(b) for b in buckets])
        self._hold(version, buckets, record)
        self.board.publish_manifest(manifest)
        self.mirror.submit(manifest, buckets)
        done = time.monotonic()
        self.last_parts = {"export_s": exported - started, "pack_s": packed - exported, "announce_s": done - packed}
        logger.info(
            "weight bus (ipc): published v%d (%.1f MiB) in %.3fs: export %.3fs, pack %.3fs, announce %.3fs; host "
            "copy of the previous version %.3fs",
            version,
            sum(sizes) / 2**20,
            done - started,
            *self.last_parts.values(),
            self.mirror.last_seconds,
        )
        return PublishStats(version, done - started, len(entries), sum(sizes), len(sizes))

    def _hold(self, version: int, buckets: list[torch.Tensor], record: CudaIpcVersion) -> None:
        """Keep this version's device buckets and publish their handles (before the manifest announces it)."""
        self.held[version] = buckets
        self.board.store_ipc_record(record)
        for old in sorted(self.held)[:-IPC_KEEP_VERSIONS]:
            # Handles first: a receiver that reads none takes tcp instead of opening memory about to be reused.
            self.board.drop_ipc_record(old)
            del self.held[old]

    def close(self) -> None:
        self.mirror.close()
        for version in list(self.held):
            try:
                self.board.drop_ipc_record(version, timeout_s=0)
            except redis.RedisError as error:  # expiring on their own; nothing is lost
                logger.warning("weight bus (ipc): could not drop the handles of v%d: %s", version, error)
        self.held.clear()
        self.fallback.close()


class HostMirror:
    """The host side of ipc versions, made off the trainer's path by one supervised thread: pinned copy of the device
    buckets -> crc32 per tensor -> tcp hold (+ disk snapshot) -> the checksummed manifest in Redis.

    At most one version waits: a newer one replaces it (its manifest stays unchecksummed; tcp receivers ask for the
    latest). Mirroring a version can take longer than a fast step (crc32 runs at a few GB/s per core), so a queue would
    grow without bound. A failure is raised at the trainer's next publish."""

    def __init__(self, sender: WeightSender, device: torch.device):
        self.sender, self.device = sender, device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.last_seconds = 0.0
        self.skipped = 0  # versions replaced before their turn
        self._state = threading.Condition()
        self._queued: tuple[WeightManifest, list[torch.Tensor]] | None = None
        self._busy, self._closed = False, False
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ipc-host-mirror", daemon=True)
        self._thread.start()

    def submit(self, manifest: WeightManifest, buckets: list[torch.Tensor]) -> None:
        with self._state:
            if self._queued is not None:
                self.skipped += 1
            self._queued = (manifest, buckets)
            self._state.notify_all()

    def raise_failure(self) -> None:
        failure = self._failure
        if failure is not None:
            raise RuntimeError(f"weight bus (ipc): the host copy of a version failed: {failure}") from failure

    def wait(self, timeout_s: float) -> None:
        """Until nothing is queued or being mirrored; raises the mirror's failure, TimeoutError after ``timeout_s``."""
        with self._state:
            idle = self._state.wait_for(lambda: self._queued is None and not self._busy, timeout=timeout_s)
        if not idle:
            raise TimeoutError(f"weight bus (ipc): the host copy did not finish within {timeout_s}s")
        self.raise_failure()

    def _run(self) -> None:
        while True:
            with self._state:
                self._state.wait_for(lambda: self._queued is not None or self._closed)
                if self._queued is None:
                    return
                job, self._queued, self._busy = self._queued, None, True
            try:
                self._mirror(*job)
            except BaseException as error:  # noqa: BLE001 - kept, raised at the trainer's next publish
                logger.error("weight bus (ipc): the host copy of v%d failed: %s", job[0].version, error)
                self._failure = error
            finally:
                with self._state:
                    self._busy = False
                    self._state.notify_all()

    def _mirror(self, manifest: WeightManifest, buckets: list[torch.Tensor]) -> None:
        started = time.monotonic()
        # From the tcp publisher's pool: a dropped version's buffers that no receiver reads any more, or new ones.
        arrays = [self.sender.tcp.allocate(bucket.numel()) for bucket in buckets]
        host = [torch.from_numpy(array) for array in arrays]
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            for bucket, copy in zip(buckets, host, strict=True):
                copy.copy_(bucket, non_blocking=self.stream is not None)
        if self.stream is not None:
            self.stream.synchronize()
        crcs = FlatHost(host).checksums(manifest.tensors)
        tensors = [msgspec.structs.replace(e, checksum=crc) for e, crc in zip(manifest.tensors, crcs, strict=True)]
        checksummed = msgspec.structs.replace(manifest, tensors=tensors, checksummed=True)
        self.sender.tcp.hold(manifest.version, arrays)
        if self.sender.snapshots is not None:
            self.sender.snapshots.begin(manifest.version)
            for array in arrays:
                self.sender.snapshots.write_bucket(array)
            self.sender.snapshots.commit(checksummed)
        self.sender.board.replace_manifest(checksummed)
        self.last_seconds = time.monotonic() - started

    def close(self, timeout_s: float = 60.0) -> None:
        try:
            self.wait(timeout_s)
        except Exception as error:  # noqa: BLE001 - closing: say what was lost, do not mask the caller's error
            logger.warning("weight bus (ipc): the last host copy did not finish before close: %s", error)
        with self._state:
            self._closed = True
            self._state.notify_all()
        self._thread.join(timeout=timeout_s)
