"""Weight bus on CPU: bucket packing + checksums, and the TCP transport (its Redis side:
tests/channels/test_version_board.py).

TCP failure cases use raw socket servers that misbehave on purpose (close early, never reply) to
check that a receiver fails fast instead of hanging.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import pytest
import torch

from protos.records import TensorEntry, WeightManifest
from weight_bus.packing import ALIGN_BYTES, ChecksumError, iter_tensors, pack, total_nbytes, verify
from weight_bus.tcp import MAGIC, TcpWeightPublisher, WeightUnavailableError, fetch

pytestmark = pytest.mark.integration

# ---------------------------------------------------------------------------------------------------
# helpers


def _joined(buckets: list[bytearray]) -> bytearray:
    return bytearray(b"".join(bytes(b) for b in buckets))


def _named_tensors() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        ("embed.weight", torch.randn(8, 4, generator=gen)),  # fp32
        ("norm.weight", torch.randn(16, generator=gen).to(torch.bfloat16)),  # bf16
        ("position_ids", torch.arange(10, dtype=torch.int64).reshape(2, 5)),  # int64
        ("big.weight", torch.randn(64, 8, generator=gen)),  # 2048 bytes > the 512-byte bucket
        ("scalar", torch.tensor(3.5)),  # 0-d
        *[(f"layer.{i}.bias", torch.full((3,), float(i))) for i in range(20)],  # many small tensors
    ]


def _assert_same_tensors(expected: list[tuple[str, torch.Tensor]], got: list[tuple[str, torch.Tensor]]) -> None:
    assert [name for name, _ in got] == [name for name, _ in expected]
    for (name, want), (_, have) in zip(expected, got, strict=False):
        assert have.dtype == want.dtype, name
        assert have.shape == want.shape, name
        assert torch.equal(have, want), name


def _manifest_for(address: str, version: int, nbytes: list[int]) -> WeightManifest:
    entries = [TensorEntry(f"t{i}", "uint8", (n,), "raw", i, 0, n, 0) for i, n in enumerate(nbytes)]
    return WeightManifest(version, entries, nbytes, address, "tcp", 0.0)


class _RawServer:
    """A one-connection-at-a-time TCP server running ``behaviour(conn)`` on a thread."""

    def __init__(self, behaviour: Callable[[socket.socket], None]):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.behaviour = behaviour
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        with conn:
            self.behaviour(conn)

    def close(self) -> None:
        self.listener.close()
        self.thread.join(timeout=5)


# ---------------------------------------------------------------------------------------------------
# packing


def test_pack_and_iter_tensors_round_trip_dtypes_shapes_and_buckets():
    tensors = _named_tensors()
    manifest, buckets = pack(tensors, version=3, bytes_per_bucket=512, publisher_address="h:1")
    assert manifest.version == 3 and manifest.publisher_address == "h:1" and manifest.transport == "tcp"
    assert manifest.bucket_nbytes == [len(b) for b in buckets]
    assert len(buckets) > 3  # the small tensors spill over several buckets
    assert total_nbytes(manifest) == sum(len(b) for b in buckets)
    by_name = {entry.name: entry for entry in manifest.tensors}
    assert by_name["norm.weight"].dtype == "bfloat16"
    assert by_name["scalar"].shape == () and by_name["scalar"].nbytes == 4
    for entry in manifest.tensors:
        assert entry.offset % ALIGN_BYTES == 0
        assert entry.codec == "raw"
    buffer = _joined(buckets)
    verify(manifest, memoryview(buffer))
    _assert_same_tensors(tensors, [(n, t.clone()) for n, t in iter_tensors(manifest, memoryview(buffer))])


def test_tensor_larger_than_the_bucket_gets_a_bucket_of_its_own():
    small, big = torch.ones(4), torch.arange(1000, dtype=torch.float32)
    manifest, buckets = pack([("a", small), ("big", big), ("c", small)], version=1, bytes_per_bucket=256)
    entries = {e.name: e for e in manifest.tensors}
    assert entries["big"].bucket != entries["a"].bucket != entries["c"].bucket
    assert entries["big"].offset == 0
    assert manifest.bucket_nbytes[entries["big"].bucket] == 4032  # 4000 bytes padded to 64-byte alignment
    got = dict(iter_tensors(manifest, memoryview(_joined(buckets))))
    assert torch.equal(got["big"], big)


def test_packing_copies_non_contiguous_tensors_in_logical_order():
    source = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    manifest, buckets = pack([("t", source)], version=1, bytes_per_bucket=1 << 20)
    ((_, got),) = list(iter_tensors(manifest, memoryview(_joined(buckets))))
    assert torch.equal(got, source)


def test_checksums_pass_on_intact_buckets():
    manifest, buckets = pack(_named_tensors(), version=1, bytes_per_bucket=512)
    verify(manifest, memoryview(_joined(buckets)))  # no raise


def test_corrupted_bucket_is_refused_with_tensor_name():
    manifest, buckets = pack(_named_tensors(), version=4, bytes_per_bucket=512)
    buffer = _joined(buckets)
    entry = next(e for e in manifest.tensors if e.name == "position_ids")
    start = sum(manifest.bucket_nbytes[: entry.bucket]) + entry.offset
    buffer[start + 5] ^= 0x01
    with pytest.raises(ChecksumError, match=r"v4: tensor position_ids .*checksum"):
        verify(manifest, memoryview(buffer))


def test_zero_element_tensor_round_trips():
    tensors = [("empty", torch.zeros(0, 4)), ("w", torch.ones(3))]
    manifest, buckets = pack(tensors, 1, bytes_per_bucket=1024)
    _assert_same_tensors(tensors, list(iter_tensors(manifest, memoryview(_joined(buckets)))))


def test_every_tensor_is_aligned_in_the_end_to_end_buffer():
    tensors = [("a", torch.arange(3, dtype=torch.int8)), ("b", torch.arange(5, dtype=torch.float32))]
    manifest, _ = pack(tensors, 1, bytes_per_bucket=16)
    starts = [sum(manifest.bucket_nbytes[: e.bucket]) + e.offset for e in manifest.tensors]
    assert all(start % ALIGN_BYTES == 0 for start in starts), (manifest.bucket_nbytes, starts)


# ---------------------------------------------------------------------------------------------------
# TCP transport


@pytest.fixture
def publisher():
    pub = TcpWeightPublisher(keep_versions=2, timeout_s=5.0)
    try:
        yield pub
    finally:
        pub.close()


def test_fetch_of_a_held_version_receives_the_buckets(publisher):
    manifest, buckets = pack(_named_tensors(), 7, bytes_per_bucket=512, publisher_address=publisher.address)
    publisher.hold(7, buckets)
    buffer = bytearray(total_nbytes(manifest))
    assert fetch(manifest, memoryview(buffer), timeout_s=5) == len(buffer)
    assert buffer == _joined(buckets)
    verify(manifest, memoryview(buffer))


def test_fetch_into_a_larger_buffer_fills_only_the_prefix(publisher):
    manifest, buckets = pack([("w", torch.ones(10))], 1, bytes_per_bucket=1 << 20, publisher_address=publisher.address)
    publisher.hold(1, buckets)
    buffer = bytearray(b"\xff" * (total_nbytes(manifest) + 16))
    assert fetch(manifest, memoryview(buffer), timeout_s=5) == total_nbytes(manifest)
    assert buffer[: total_nbytes(manifest)] == _joined(buckets)
    assert buffer[total_nbytes(manifest) :] == b"\xff" * 16


def test_fetch_into_a_too_small_buffer_is_refused_before_connecting():
    manifest = _manifest_for("127.0.0.1:1", 1, [100])
    with pytest.raises(ValueError, match=r"holds 99 bytes, version needs 100"):
        fetch(manifest, memoryview(bytearray(99)), timeout_s=1)


def test_two_concurrent_receivers_get_identical_bytes(publisher):
    big = torch.randn(256, 1024, generator=torch.Generator().manual_seed(1))  # 1 MiB
    manifest, buckets = pack(
        [("big", big), *_named_tensors()], 2, bytes_per_bucket=1 << 18, publisher_address=publisher.address
    )
    publisher.hold(2, buckets)
    results: dict[int, bytearray] = {}
    errors: list[BaseException] = []

    def receive(i: int) -> None:
        try:
            buffer = bytearray(total_nbytes(manifest))
            fetch(manifest, memoryview(buffer), timeout_s=10)
            results[i] = buffer
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=receive, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert not errors
    assert results[0] == results[1] == _joined(buckets)


def test_fetching_an_unheld_version_raises_weight_unavailable_with_the_held_versions(publisher):
    manifest, buckets = pack([("w", torch.ones(3))], 1, 1024, publisher_address=publisher.address)
    publisher.hold(1, buckets)
    missing = _manifest_for(publisher.address, 9, manifest.bucket_nbytes)
    with pytest.raises(WeightUnavailableError, match=r"version 9 is not held \(held: \[1\]\)"):
        fetch(missing, memoryview(bytearray(total_nbytes(missing))), timeout_s=5)


def test_failed_fetch_into_an_mmap_leaves_no_view_so_the_staging_map_can_close(publisher, tmp_path):
    # A rollout server stages into an mmap; a fetch that fails (version superseded) must not keep
    # views alive, or closing the map raises BufferError and kills the weight follower.
    import mmap

    manifest, buckets = pack([("w", torch.ones(3))], 1, 1024, publisher_address=publisher.address)
    publisher.hold(1, buckets)
    missing = _manifest_for(publisher.address, 9, manifest.bucket_nbytes)
    size = total_nbytes(missing)
    with open(tmp_path / "staging", "wb+") as staging, pytest.raises(WeightUnavailableError):
        staging.truncate(size)
        # As in rollout_service.weight_sync: the map closes while the fetch error propagates.
        with mmap.mmap(staging.fileno(), size) as buffer:
            view = memoryview(buffer)
            try:
                fetch(missing, view, timeout_s=5)
            finally:
                view.release()


def test_keep_versions_drops_the_oldest_versions(publisher):
    manifests = {}
    for version in (1, 2, 3):
        manifests[version], buckets = pack(
            [("w", torch.full((4,), float(version)))], version, 1024, publisher_address=publisher.address
        )
        publisher.hold(version, buckets)
    assert publisher.versions() == [2, 3]
    assert publisher.buckets_of(1) is None
    with pytest.raises(WeightUnavailableError, match=r"version 1 is not held"):
        fetch(manifests[1], memoryview(bytearray(total_nbytes(manifests[1]))), timeout_s=5)
    buffer = bytearray(total_nbytes(manifests[3]))
    fetch(manifests[3], memoryview(buffer), timeout_s=5)
    ((_, tensor),) = list(iter_tensors(manifests[3], memoryview(buffer)))
    assert torch.equal(tensor, torch.full((4,), 3.0))


def test_fetch_from_a_closed_publisher_is_refused_fast():
    pub = TcpWeightPublisher(timeout_s=5.0)
    manifest, buckets = pack([("w", torch.ones(4))], 1, 1024, publisher_address=pub.address)
    pub.hold(1, buckets)
    pub.close()
    started = time.monotonic()
    with pytest.raises(OSError):
        fetch(manifest, memoryview(bytearray(total_nbytes(manifest))), timeout_s=2)
    assert time.monotonic() - started < 2


def test_publisher_dying_after_the_header_raises_connection_error_not_hang():
    def header_then_close(conn: socket.socket) -> None:
        conn.recv(len(MAGIC) + 8)
        conn.sendall((1000).to_bytes(8, "little") + b"\x00" * 100)  # 100 of 1000 promised bytes

    server = _RawServer(header_then_close)
    manifest = _manifest_for(server.address, 5, [1000])
    started = time.monotonic()
    try:
        with pytest.raises(ConnectionError, match=r"peer closed after 100 of 1000 bytes"):
            fetch(manifest, memoryview(bytearray(1000)), timeout_s=5)
    finally:
        server.close()
    assert time.monotonic() - started < 4


def test_publisher_closing_before_the_header_raises_connection_error():
    def close_at_once(conn: socket.socket) -> None:
        conn.recv(len(MAGIC) + 8)

    server = _RawServer(close_at_once)
    try:
        with pytest.raises(ConnectionError, match=r"peer closed after 0 of 8 bytes"):
            fetch(_manifest_for(server.address, 1, [10]), memoryview(bytearray(10)), timeout_s=5)
    finally:
        server.close()


def test_publisher_announcing_another_size_than_the_manifest_is_refused():
    def wrong_total(conn: socket.socket) -> None:
        conn.recv(len(MAGIC) + 8)
        conn.sendall((64).to_bytes(8, "little"))

    server = _RawServer(wrong_total)
    try:
        with pytest.raises(ConnectionError, match=r"sends 64 bytes, manifest says 10"):
            fetch(_manifest_for(server.address, 1, [10]), memoryview(bytearray(10)), timeout_s=5)
    finally:
        server.close()


def test_stalled_publisher_times_out_within_the_deadline():
    release = threading.Event()

    def never_reply(conn: socket.socket) -> None:
        release.wait(10)  # accept, read nothing, send nothing

    server = _RawServer(never_reply)
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError):  # socket.timeout is TimeoutError
            fetch(_manifest_for(server.address, 1, [10]), memoryview(bytearray(10)), timeout_s=1.0)
    finally:
        release.set()
        server.close()
    elapsed = time.monotonic() - started
    assert 0.9 <= elapsed < 3


def test_request_without_magic_is_dropped_and_the_publisher_keeps_serving(publisher):
    host, port = publisher.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"NOTMAGIC" + (1).to_bytes(8, "little"))
        assert sock.recv(8) == b""  # closed without a reply
    manifest, buckets = pack([("w", torch.ones(2))], 1, 1024, publisher_address=publisher.address)
    publisher.hold(1, buckets)
    buffer = bytearray(total_nbytes(manifest))
    fetch(manifest, memoryview(buffer), timeout_s=5)
    assert buffer == _joined(buckets)
