"""Failure handling of the tcp weight bus with real parts: a stalled receiver, a closed publisher with a
disk snapshot, corrupted buckets, a late receiver whose Redis lost the manifest, receive modes."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
import redis
import torch

from protos.config import WeightBusConfig
from protos.records import decode_manifest
from protos.redis_keys import RedisKeys
from tests.waiting import wait_until
from trainer_service.publisher import WeightPublisher
from weight_bus import receiver, snapshot
from weight_bus.packing import ChecksumError, iter_tensors, pack, total_nbytes
from weight_bus.sender import WeightSender
from weight_bus.tcp import MAGIC, TcpWeightPublisher, fetch

pytestmark = pytest.mark.integration


def _weights(seed: int, rows: int = 64) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(rows, 64, generator=gen).to(torch.bfloat16)),
        ("model.layers.0.input_layernorm.weight", torch.randn(64, generator=gen)),
        ("model.layers.0.mlp.experts.0.down_proj.weight", torch.randn(64, rows, generator=gen).to(torch.bfloat16)),
    ]


def _stall(address: str, version: int) -> socket.socket:
    """A receiver that asks for ``version`` and then never reads (tiny receive buffer)."""
    host, port = address.rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    sock.sendall(MAGIC + version.to_bytes(8, "little"))
    return sock


def _fetch_in_threads(manifest, count: int) -> tuple[list[bytearray], list[BaseException]]:
    results: list[bytearray] = []
    errors: list[BaseException] = []

    def receive() -> None:
        try:
            buffer = bytearray(total_nbytes(manifest))
            fetch(manifest, memoryview(buffer), timeout_s=20)
            results.append(buffer)
        except BaseException as error:  # noqa: BLE001 - asserted by the test
            errors.append(error)

    threads = [threading.Thread(target=receive) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return results, errors


def test_stalled_receiver_neither_delays_the_others_nor_holds_the_publisher_beyond_the_timeout():
    timeout_s = 5.0  # generous: this 2-core machine is shared, and the point is "bounded", not "fast"
    publisher = TcpWeightPublisher(timeout_s=timeout_s)
    stalled = None
    try:
        big = torch.randn(4 << 20, generator=torch.Generator().manual_seed(0))  # 16 MiB: beyond socket buffers
        manifest, buckets = pack([("big", big)], 1, 1 << 30, publisher_address=publisher.address)
        publisher.hold(1, buckets)
        stalled = _stall(publisher.address, 1)
        stalled_at = time.monotonic()
        # its sending thread took the buckets; with 16 MiB to write into a 4 KiB buffer it now blocks on a full socket
        wait_until(lambda: publisher._sending.get(1), "the publisher sending v1 to the stalled receiver", 10)
        results, errors = _fetch_in_threads(manifest, 2)
        healthy_s = time.monotonic() - stalled_at
        assert not errors and len(results) == 2
        assert all(bytes(r) == bytes(buckets[0]) for r in results)
        assert healthy_s < timeout_s, healthy_s  # the survivors did not wait for the stalled one
        wait_until(lambda: publisher.num_gave_up, "the publisher giving up on the stalled receiver", timeout_s + 10)
        assert time.monotonic() - stalled_at >= timeout_s * 0.9  # it waited for the deadline, not less
        # a send is counted when its thread returns, which may be just after the receiver has it all
        wait_until(lambda: publisher.num_served == 2, "both healthy sends counted", 10)
        results, errors = _fetch_in_threads(manifest, 1)  # and it keeps serving
        assert not errors
        wait_until(lambda: publisher.num_served == 3, "the third send counted", 10)
    finally:
        if stalled is not None:
            stalled.close()
        publisher.close()


def test_receiver_dying_mid_transfer_is_counted_and_others_are_served():
    publisher = TcpWeightPublisher(timeout_s=5.0)
    try:
        big = torch.randn(8 << 20, generator=torch.Generator().manual_seed(1))
        manifest, buckets = pack([("big", big)], 1, 1 << 30, publisher_address=publisher.address)
        publisher.hold(1, buckets)
        dying = _stall(publisher.address, 1)
        dying.recv(1 << 16)
        dying.close()  # gone after a few bytes
        results, errors = _fetch_in_threads(manifest, 1)
        assert not errors and bytes(results[0]) == bytes(buckets[0])
        wait_until(lambda: publisher.num_gave_up == 1, "the dying receiver counted as given up", 10)
    finally:
        publisher.close()


@pytest.fixture
def sender_factory(redis_url, tmp_path):
    made: list[WeightSender] = []

    def make(**overrides) -> WeightSender:
        config = WeightBusConfig(bucket_mib=0.01, snapshot_dir=str(tmp_path / "snapshots"), **overrides)
        sender = WeightSender(redis.Redis.from_url(redis_url), RedisKeys("snap"), config)
        made.append(sender)
        return sender

    yield make
    for sender in made:
        sender.close()


def _redis_manifest(redis_url: str, version: int):
    return decode_manifest(redis.Redis.from_url(redis_url).get(RedisKeys("snap").manifest(version)))


def test_receiver_loads_the_snapshot_when_the_publisher_is_closed(sender_factory, redis_url, tmp_path):
    sender = sender_factory(codec="mxfp8", keep_snapshots=2)
    for version in (1, 2, 3):
        sender.publish(version, _weights(version))
    assert snapshot.versions(tmp_path / "snapshots") == [2, 3]  # the last keep_snapshots
    assert [p.name for p in (tmp_path / "snapshots").iterdir() if p.name.startswith(".")] == []  # no temp dirs
    manifest = _redis_manifest(redis_url, 3)
    live = bytearray(total_nbytes(manifest))
    snapshot_dir = sender.config.snapshot_dir
    assert receiver.receive_into(manifest, memoryview(live), timeout_s=5, snapshot_dir=snapshot_dir) == "publisher"
    sender.close()  # the real tcp publisher is gone
    with pytest.raises(OSError):
        receiver.receive_into(manifest, memoryview(bytearray(len(live))), timeout_s=2)
    from_disk = bytearray(len(live))
    source = receiver.receive_into(manifest, memoryview(from_disk), timeout_s=2, snapshot_dir=snapshot_dir)
    assert source == "snapshot" and from_disk == live  # same bytes, so the same checksums passed
    got = dict(iter_tensors(manifest, memoryview(from_disk), dequantize_to=torch.bfloat16))
    assert torch.equal(got["model.layers.0.input_layernorm.weight"], _weights(3)[1][1])


def test_snapshot_of_another_manifest_or_version_is_refused(sender_factory, redis_url):
    sender = sender_factory(keep_snapshots=1)
    sender.publish(1, _weights(1))
    manifest_1 = _redis_manifest(redis_url, 1)
    sender.publish(2, _weights(2))
    sender.close()
    snapshot_dir = sender.config.snapshot_dir
    with pytest.raises(snapshot.SnapshotMissingError, match="no snapshot of v1"):
        receiver.receive_into(manifest_1, memoryview(bytearray(total_nbytes(manifest_1))), 2, snapshot_dir)
    other = _redis_manifest(redis_url, 2)
    tampered = type(other)(2, manifest_1.tensors, manifest_1.bucket_nbytes, other.publisher_address, "tcp", 0.0)
    with pytest.raises(snapshot.SnapshotMissingError, match="another manifest"):
        receiver.receive_into(tampered, memoryview(bytearray(total_nbytes(tampered))), 2, sender.config.snapshot_dir)


def test_corrupted_bucket_is_refused_and_never_replaced_by_the_snapshot(sender_factory, redis_url):
    sender = sender_factory()
    sender.publish(4, _weights(4))
    manifest = _redis_manifest(redis_url, 4)
    sender.tcp.buckets_of(4)[0][100] ^= 0xFF  # flipped in flight; the snapshot on disk is intact
    with pytest.raises(ChecksumError, match=r"v4: tensor model\.layers\.0\.self_attn\.q_proj\.weight"):
        receiver.receive_into(manifest, memoryview(bytearray(total_nbytes(manifest))), 5, sender.config.snapshot_dir)


def test_late_receiver_finds_the_manifest_with_the_snapshot_when_redis_lost_it(sender_factory, redis_url):
    sender = sender_factory()
    sender.publish(7, _weights(7))
    published = _redis_manifest(redis_url, 7)
    redis.Redis.from_url(redis_url).flushall()
    sender.close()
    assert receiver.latest_snapshot_version(sender.config.snapshot_dir) == 7  # how far the trainer got
    assert receiver.latest_snapshot_version("") == 0
    manifest = receiver.resolve_manifest(None, 7, sender.config.snapshot_dir)
    assert manifest == published
    assert receiver.resolve_manifest(None, 8, sender.config.snapshot_dir) is None
    assert receiver.resolve_manifest(None, 7, "") is None
    buffer = bytearray(total_nbytes(manifest))
    assert receiver.receive_into(manifest, memoryview(buffer), 2, sender.config.snapshot_dir) == "snapshot"


def test_weight_publisher_keeps_its_interface(redis_url):
    publisher = WeightPublisher(redis.Redis.from_url(redis_url), RedisKeys("pub"), WeightBusConfig(codec="mxfp8"))
    try:
        seconds = publisher.publish(1, _weights(1))
        assert seconds > 0 and publisher.num_published == 1
        bucket = publisher.transport.buckets_of(1)[0]
        bucket[len(bucket) // 2] ^= 0xFF  # tests flip a byte in flight this way
        assert isinstance(bucket, np.ndarray | bytearray)
        assert publisher.last_stats.num_tensors == 5  # 2 quantized weights -> 2 pairs, 1 norm
    finally:
        publisher.close()


def test_receive_modes_fail_clearly_when_the_engine_cannot_honour_them():
    receiver.check_receive_mode("dequantize", serves_mxfp8=False, cuda_available=False)
    receiver.check_receive_mode("mxfp8", serves_mxfp8=True, cuda_available=True)
    with pytest.raises(ValueError, match=r"vLLM on CPU cannot serve an MXFP8 checkpoint.*'dequantize'"):
        receiver.check_receive_mode("mxfp8", serves_mxfp8=False, cuda_available=False)
    with pytest.raises(ValueError, match=r"serves unquantized weights"):
        receiver.check_receive_mode("mxfp8", serves_mxfp8=False, cuda_available=True)
    with pytest.raises(ValueError, match=r"set weight_bus.receive_mode='mxfp8'"):
        receiver.check_receive_mode("dequantize", serves_mxfp8=True, cuda_available=True)
    with pytest.raises(ValueError, match=r"receive_mode='mxfp8' needs weight_bus.codec='mxfp8'"):
        WeightBusConfig(receive_mode="mxfp8")


def test_buffers_of_a_dropped_version_are_reused_only_once_no_receiver_reads_them():
    publisher = TcpWeightPublisher(keep_versions=1)
    try:
        first = [np.full(1024, 1, dtype=np.uint8)]
        publisher.hold(1, first)
        assert publisher.begin_send(1) is first  # a receiver is still reading v1
        publisher.hold(2, [np.zeros(1024, dtype=np.uint8)])  # v1 dropped while being sent
        assert publisher.buckets_of(1) is None
        assert publisher.allocate(1024) is not first[0]
        publisher.end_send(1)  # the receiver is done: v1's memory may be reused
        assert publisher.allocate(1024) is first[0]
        assert publisher.allocate(1024) is not first[0]  # handed out once
    finally:
        publisher.close()


def test_publisher_packs_later_versions_into_recycled_buckets(redis_url):
    sender = WeightSender(redis.Redis.from_url(redis_url), RedisKeys("recycle"), WeightBusConfig(keep_versions=1))
    try:
        sender.publish(1, _weights(1))
        first = sender.tcp.buckets_of(1)[0]
        sender.publish(2, _weights(2))  # drops v1 into the pool
        sender.publish(3, _weights(3))  # packs into v1's memory
        assert sender.tcp.buckets_of(3)[0] is first
        manifest = _redis_manifest_of(redis_url, "recycle", 3)
        buffer = bytearray(total_nbytes(manifest))
        assert receiver.receive_into(manifest, memoryview(buffer), 5) == "publisher"  # checksums hold
    finally:
        sender.close()


def _redis_manifest_of(redis_url: str, run_id: str, version: int):
    return decode_manifest(redis.Redis.from_url(redis_url).get(RedisKeys(run_id).manifest(version)))
