"""Weight bus on CPU: the TCP transport (weight_bus.tcp).

Failure cases use raw socket servers that misbehave on purpose (close early, never reply) to check that a
receiver fails fast instead of hanging.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch

from protos.records import TensorEntry, WeightManifest
from tests.weight_bus.bus_tensors import joined_buckets, named_tensors
from weight_bus.packing import ChecksumError, iter_tensors, pack, total_nbytes, verify
from weight_bus.tcp import MAGIC, TcpWeightPublisher, WeightUnavailableError, fetch

pytestmark = pytest.mark.integration

# ---------------------------------------------------------------------------------------------------
# helpers


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
# TCP transport


@pytest.fixture
def publisher():
    pub = TcpWeightPublisher(keep_versions=2, timeout_s=5.0)
    try:
        yield pub
    finally:
        pub.close()


def test_fetch_of_a_held_version_receives_the_buckets(publisher):
    manifest, buckets = pack(named_tensors(), 7, bytes_per_bucket=512, publisher_address=publisher.address)
    publisher.hold(7, buckets)
    buffer = bytearray(total_nbytes(manifest))
    assert fetch(manifest, memoryview(buffer), timeout_s=5) == len(buffer)
    assert buffer == joined_buckets(buckets)
    verify(manifest, memoryview(buffer))


def test_fetch_into_a_larger_buffer_fills_only_the_prefix(publisher):
    manifest, buckets = pack([("w", torch.ones(10))], 1, bytes_per_bucket=1 << 20, publisher_address=publisher.address)
    publisher.hold(1, buckets)
    buffer = bytearray(b"\xff" * (total_nbytes(manifest) + 16))
    assert fetch(manifest, memoryview(buffer), timeout_s=5) == total_nbytes(manifest)
    assert buffer[: total_nbytes(manifest)] == joined_buckets(buckets)
    assert buffer[total_nbytes(manifest) :] == b"\xff" * 16


def test_fetch_into_a_too_small_buffer_is_refused_before_connecting():
    manifest = _manifest_for("127.0.0.1:1", 1, [100])
    with pytest.raises(ValueError, match=r"holds 99 bytes, version needs 100"):
        fetch(manifest, memoryview(bytearray(99)), timeout_s=1)


def test_two_concurrent_receivers_get_identical_bytes(publisher):
    big = torch.randn(256, 1024, generator=torch.Generator().manual_seed(1))  # 1 MiB
    manifest, buckets = pack(
        [("big", big), *named_tensors()], 2, bytes_per_bucket=1 << 18, publisher_address=publisher.address
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
    assert results[0] == results[1] == joined_buckets(buckets)


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
    assert buffer == joined_buckets(buckets)


# ---------------------------------------------------------------------------------------------------
# recycled buffers and checksums on receipt


def _reader_in_the_middle(address: str, version: int) -> socket.socket:
    """A receiver that asked for ``version`` and read only the header: the publisher is sending it."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(MAGIC + version.to_bytes(8, "little"))
    header = sock.recv(8, socket.MSG_WAITALL)
    assert int.from_bytes(header, "little") > 0
    return sock


def _read_to_the_end(sock: socket.socket) -> bytes:
    """The rest of the reply; returns once the publisher has closed the connection (its send is over)."""
    chunks = []
    with sock:
        while chunk := sock.recv(1 << 20):
            chunks.append(chunk)
    return b"".join(chunks)


def test_a_recycled_buffer_is_not_handed_out_while_its_version_is_held_or_read():
    made: list[np.ndarray] = []

    def new_buffer(nbytes: int) -> np.ndarray:
        made.append(np.empty(nbytes, dtype=np.uint8))
        return made[-1]

    size = 32 << 20  # more than the sockets buffer: the publisher stays in the middle of sending v2
    pub = TcpWeightPublisher(keep_versions=2, timeout_s=10.0, new_buffer=new_buffer)
    try:
        versions = {}
        for version in (1, 2, 3):
            versions[version] = [pub.allocate(size)]
            versions[version][0][:] = version
            pub.hold(version, versions[version])  # v3's hold drops v1, which nobody reads
        assert len(made) == 3  # v1 and v2 were held while v3 was allocated: new memory
        reader = _reader_in_the_middle(pub.address, 2)
        assert pub.allocate(size) is versions[1][0]  # dropped and unread: recycled
        pub.hold(4, [np.full(size, 4, dtype=np.uint8)])  # drops v2 while the receiver reads it
        fifth = pub.allocate(size)
        assert fifth is not versions[2][0] and len(made) == 4  # v2's memory is not handed out
        fifth[:] = 5
        assert set(_read_to_the_end(reader)) == {2}  # the receiver got v2's bytes, none overwritten
        assert pub.allocate(size) is versions[2][0]  # its send is over: now it is recycled
    finally:
        pub.close()


def test_a_receiver_refuses_a_byte_corrupted_in_a_multi_chunk_tensor_naming_it(publisher):
    from weight_bus import receiver
    from weight_bus.checksums import CHUNK_BYTES

    big = torch.arange(2 * CHUNK_BYTES // 4 + 3, dtype=torch.int32)  # spans three checksum chunks
    manifest, buckets = pack([("a", torch.ones(4)), ("layers.0.big", big)], 9, 1 << 20, publisher.address)
    entry = manifest.tensors[1]
    buckets[entry.bucket][entry.offset + CHUNK_BYTES + 5] ^= 0x10  # one bit, in its second chunk
    publisher.hold(9, buckets)
    into = bytearray(total_nbytes(manifest))
    with pytest.raises(ChecksumError, match=r"v9: tensor layers\.0\.big \(bucket 1\) failed its checksum"):
        receiver.receive_into(manifest, memoryview(into), timeout_s=10.0)
