"""The CUDA IPC transport's device-independent parts on CPU: reading tensors out of bucket tensors, the openability
check, and the publisher's fallback to tcp without CUDA. The CUDA IPC round trip itself runs on the GPU machine
(scripts/gpu_checks.py, section "weights")."""

from __future__ import annotations

import os

import numpy as np
import pytest
import redis
import torch

from protos.config import WeightBusConfig
from protos.records import CudaIpcBucket, CudaIpcVersion, decode_ipc_version, encode
from protos.redis_keys import RedisKeys
from tests.weight_bus.ipc_manifests import announced_before_checksums
from trainer_service.publisher import WeightPublisher
from weight_bus import packing
from weight_bus.ipc import iter_device_tensors, why_not_openable
from weight_bus.sender import WeightSender

pytestmark = pytest.mark.integration


def _named():
    torch.manual_seed(0)
    return [
        ("model.layers.0.mlp.experts.0.up_proj.weight", torch.randn(64, 64, dtype=torch.bfloat16)),
        ("model.layers.0.mlp.gate.weight", torch.randn(8, 64, dtype=torch.float32)),
        ("model.norm.weight", torch.randn(64, dtype=torch.bfloat16)),
    ]


def test_tensors_read_from_bucket_tensors_equal_those_read_from_the_host_bytes():
    for codec in (packing.RAW, packing.WireCodec("mxfp8")):
        manifest, buckets = packing.pack(_named(), 1, 4096, codec=codec)
        host = memoryview(b"".join(np.asarray(b).tobytes() for b in buckets))
        as_tensors = [torch.from_numpy(np.asarray(b)) for b in buckets]  # what open_version gives, on the GPU
        for dequantize_to in (None, torch.bfloat16):
            from_host = list(packing.iter_tensors(manifest, host, dequantize_to))
            from_buckets = list(iter_device_tensors(manifest, as_tensors, dequantize_to))
            assert [n for n, _ in from_host] == [n for n, _ in from_buckets]
            for (_, a), (_, b) in zip(from_host, from_buckets, strict=True):
                assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _record(pid: int) -> CudaIpcVersion:
    bucket = CudaIpcBucket(64, 0, b"\x01" * 64, 64, 0, b"ref", 0, b"", False)
    return CudaIpcVersion(3, "GPU-0000", pid, [bucket])


def test_ipc_records_round_trip_and_are_refused_where_they_cannot_be_opened():
    record = _record(os.getpid() + 1)
    assert decode_ipc_version(encode(record)) == record
    assert why_not_openable(record, torch.device("cpu")) == "no CUDA device here"


def test_ipc_transport_without_cuda_at_the_trainer_publishes_over_tcp(redis_url):
    client = redis.Redis.from_url(redis_url)
    publisher = WeightPublisher(client, RedisKeys("ipc-cpu"), WeightBusConfig(transport="ipc"))
    try:
        assert isinstance(publisher.sender, WeightSender)
        publisher.publish(1, _named())
        assert client.get(RedisKeys("ipc-cpu").ipc_buckets(1)) is None  # no handles: receivers use tcp
    finally:
        publisher.close()


def test_an_ipc_version_announced_before_its_checksums_gets_them_from_the_host_mirror(redis_url, tmp_path):
    """The ipc publisher announces a version before its host copy; the mirror then holds the bytes on tcp, writes
    the snapshot and replaces the stored manifest with the checksummed one, which a tcp receiver verifies."""
    from channels.version_board import VersionBoard
    from weight_bus import receiver
    from weight_bus.ipc import HostMirror

    client = redis.Redis.from_url(redis_url)
    keys = RedisKeys("ipc-mirror")
    config = WeightBusConfig(transport="ipc", snapshot_dir=str(tmp_path))
    sender = WeightSender(client, keys, config, transport="ipc", recycle=False)
    mirror = HostMirror(sender, torch.device("cpu"))
    try:
        manifest, buckets = packing.pack(_named(), 4, 4096)
        unchecked = announced_before_checksums(manifest, sender.tcp.address)
        VersionBoard(client, keys).publish_manifest(unchecked)
        mirror.submit(unchecked, [torch.from_numpy(np.asarray(b)) for b in buckets])
        mirror.wait(timeout_s=30)
        stored = VersionBoard(client, keys).manifest(4)
        assert stored.checksummed and [e.checksum for e in stored.tensors] == [e.checksum for e in manifest.tensors]
        into = bytearray(packing.total_nbytes(stored))
        assert receiver.receive_into(stored, memoryview(into), 10.0, None) == "publisher"  # verified on arrival
        assert receiver.resolve_manifest(None, 4, str(tmp_path)) == stored  # the snapshot has it too
    finally:
        mirror.close()
        sender.close()


def test_a_failed_host_copy_stops_the_next_publish_with_its_cause(redis_url):
    from weight_bus.ipc import HostMirror

    sender = WeightSender(redis.Redis.from_url(redis_url), RedisKeys("ipc-fail"), WeightBusConfig(), recycle=False)
    mirror = HostMirror(sender, torch.device("cpu"))
    try:
        manifest, _ = packing.pack(_named(), 1, 4096)
        mirror.submit(manifest, [])  # no buckets for the manifest's entries: the checksums cannot be computed
        with pytest.raises(RuntimeError, match="host copy of a version failed"):
            mirror.wait(timeout_s=30)
        with pytest.raises(RuntimeError, match="host copy of a version failed"):
            mirror.raise_failure()  # what the next publish calls first
    finally:
        mirror.close()
        sender.close()


def test_a_version_waiting_for_its_host_copy_is_replaced_by_a_newer_one(redis_url):
    """Mirroring is slower than a fast step: only the newest waiting version is mirrored, the queue never grows."""
    import threading

    from weight_bus.ipc import HostMirror

    sender = WeightSender(redis.Redis.from_url(redis_url), RedisKeys("ipc-coalesce"), WeightBusConfig(), recycle=False)
    mirror = HostMirror(sender, torch.device("cpu"))
    started, release, mirrored = threading.Event(), threading.Event(), []

    def slow_mirror(manifest, buckets):
        mirrored.append(manifest.version)
        started.set()
        assert release.wait(timeout=30)

    mirror._mirror = slow_mirror
    try:
        manifest, _ = packing.pack(_named(), 1, 4096)
        mirror.submit(manifest, [])
        assert started.wait(timeout=30)  # v1 is being mirrored
        for version in (2, 3):
            mirror.submit(msgspec_replace(manifest, version), [])
        release.set()
        mirror.wait(timeout_s=30)
        assert mirrored == [1, 3] and mirror.skipped == 1
    finally:
        release.set()
        mirror.close()
        sender.close()


def msgspec_replace(manifest, version: int):
    import msgspec

    return msgspec.structs.replace(manifest, version=version)


def test_the_host_mirror_copies_later_versions_into_the_host_buffers_of_a_dropped_one(redis_url):
    """Allocating GBs of pinned host memory per version is slow: the mirror takes its host buckets from the tcp
    publisher's pool, which gets a version's buffers back only once it is dropped and no receiver reads it."""
    import msgspec

    from channels.version_board import VersionBoard
    from weight_bus import receiver
    from weight_bus.ipc import HostMirror

    client, keys = redis.Redis.from_url(redis_url), RedisKeys("ipc-recycle")
    board = VersionBoard(client, keys)
    sender = WeightSender(client, keys, WeightBusConfig(keep_versions=1), transport="ipc")
    mirror = HostMirror(sender, torch.device("cpu"))
    try:
        for version in (1, 2, 3):
            named = [(name, tensor + version) for name, tensor in _named()]
            manifest, buckets = packing.pack(named, version, 4096, publisher_address=sender.tcp.address)
            board.publish_manifest(msgspec.structs.replace(manifest, checksummed=False))  # as the ipc publisher does
            mirror.submit(manifest, [torch.from_numpy(np.asarray(b)) for b in buckets])
            mirror.wait(timeout_s=30)
            if version == 1:
                first = sender.tcp.buckets_of(1)[0]
            if version == 2:
                assert sender.tcp.buckets_of(2)[0] is not first  # v1 was still held when v2 was copied
        assert sender.tcp.buckets_of(3)[0] is first  # v2's hold dropped v1 into the pool
        stored = board.manifest(3)
        assert stored.checksummed and stored.tensors == manifest.tensors
        into = bytearray(packing.total_nbytes(stored))
        assert receiver.receive_into(stored, memoryview(into), 10.0) == "publisher"  # checksums of v3's bytes
        assert bytes(into) == b"".join(np.asarray(b).tobytes() for b in buckets)
    finally:
        mirror.close()
        sender.close()
