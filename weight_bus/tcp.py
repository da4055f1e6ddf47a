"""TCP transport of the weight bus, for machines without GPUs.

The publisher (trainer side) serves the buckets of its last few versions; each receiver (rollout
server) pulls one version straight into a buffer it owns (``recv_into``: no intermediate copies).
Blocking sockets on threads: the work is pure I/O, the GIL is released during it. Each receiver has
its own sending thread, and every send carries a progress deadline (``timeout_s`` per chunk of
``SEND_CHUNK_BYTES``): a receiver that stalls or dies costs only its own thread, which gives up on it,
and never delays the others.

Wire protocol, little-endian: request = MAGIC + int64 version. Reply = int64 total bytes followed by
the buckets end to end, or int64 -1 + int64 length + utf-8 error message.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import struct
import threading
from collections.abc import Callable

import numpy as np

from protos.records import WeightManifest

logger = logging.getLogger(__name__)

MAGIC = b"FLRLWB01"
_HEADER = struct.Struct("<q")
# One deadline per chunk: a slow but moving receiver is served, one without progress is dropped.
SEND_CHUNK_BYTES = 4 << 20


class WeightUnavailableError(RuntimeError):
    """The publisher no longer (or not yet) holds the requested version."""


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        publisher: TcpWeightPublisher = self.server.publisher  # type: ignore[attr-defined]
        sock: socket.socket = self.request
        sock.settimeout(publisher.timeout_s)
        try:
            request = _recv_exact(sock, len(MAGIC) + _HEADER.size)
        except (TimeoutError, ConnectionError) as error:
            logger.warning("weight bus: no request from %s: %s", self.client_address[0], error)
            return
        if request[: len(MAGIC)] != MAGIC:
            logger.warning("weight bus: rejected a request without the protocol magic")
            return
        (version,) = _HEADER.unpack(request[len(MAGIC) :])
        buckets = publisher.begin_send(version)
        if buckets is None:
            message = f"version {version} is not held (held: {publisher.versions()})".encode()
            sock.sendall(_HEADER.pack(-1) + _HEADER.pack(len(message)) + message)
            return
        try:
            self._send(publisher, sock, version, buckets)
        finally:
            publisher.end_send(version)

    def _send(self, publisher: TcpWeightPublisher, sock: socket.socket, version: int, buckets: list) -> None:
        peer = "{}:{}".format(*self.client_address[:2])
        try:
            sock.sendall(_HEADER.pack(sum(len(b) for b in buckets)))
            for bucket in buckets:
                _send_chunked(sock, memoryview(bucket).cast("B"))
        except TimeoutError:
            publisher.count_gave_up()
            logger.warning(
                "weight bus: gave up sending v%d to %s: no progress for %.1fs", version, peer, publisher.timeout_s
            )
            return
        except OSError as error:  # the receiver went away; nothing to do but stop sending to it
            publisher.count_gave_up()
            logger.warning("weight bus: receiver %s of v%d went away: %s", peer, version, error)
            return
        publisher.count_served()


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


def _send_chunked(sock: socket.socket, view: memoryview) -> None:
    for start in range(0, view.nbytes, SEND_CHUNK_BYTES):
        with view[start : start + SEND_CHUNK_BYTES] as chunk:
            sock.sendall(chunk)


class TcpWeightPublisher:
    """Serves published versions to receivers on ``host:port`` from a background thread.

    ``timeout_s`` is the progress deadline of each send to one receiver (see the module docstring).
    With ``recycle``, the buffers of a dropped version (once no receiver is still reading them) are
    handed out again by ``allocate``: writing into fresh memory costs page faults, about 4x a copy, and
    pinned memory (``new_buffer`` on a GPU machine) costs far more to allocate than to fill.
    ``new_buffer(nbytes)`` makes a uint8 array when none of that size is free.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        keep_versions: int = 2,
        timeout_s: float = 60.0,
        recycle: bool = True,
        new_buffer: Callable[[int], np.ndarray] | None = None,
    ):
        self.keep_versions = keep_versions
        self.timeout_s = timeout_s
        self.recycle = recycle
        self.new_buffer = new_buffer or _new_array
        self.num_served = 0
        self.num_gave_up = 0
        self._lock = threading.Lock()
        self._held: dict[int, list] = {}
        self._sending: dict[int, int] = {}  # version -> receivers being sent it
        self._retired: dict[int, list] = {}  # dropped while still being sent
        self._free: dict[int, list[np.ndarray]] = {}  # size -> reusable bucket buffers
        self._server = _Server((host, port), _Handler)
        self._server.publisher = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._server.serve_forever, name="weight-bus-tcp", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{host}:{port}"

    def count_served(self) -> None:
        with self._lock:
            self.num_served += 1

    def count_gave_up(self) -> None:
        with self._lock:
            self.num_gave_up += 1

    def hold(self, version: int, buckets: list) -> None:
        """Make ``version`` fetchable; drops versions beyond ``keep_versions``."""
        with self._lock:
            self._held[version] = buckets
            for old in sorted(self._held)[: -self.keep_versions]:
                dropped = self._held.pop(old)
                if self._sending.get(old):
                    self._retired[old] = dropped
                else:
                    self._recycle(dropped)

    def allocate(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer for a bucket: a recycled one of that size if free, else a new one."""
        with self._lock:
            pool = self._free.get(nbytes)
            if pool:
                return pool.pop()
        return self.new_buffer(nbytes)

    def _recycle(self, buckets: list) -> None:
        if not self.recycle:
            return
        self._free = {}  # at most one dropped version is kept for reuse
        for bucket in buckets:
            if isinstance(bucket, np.ndarray):
                self._free.setdefault(len(bucket), []).append(bucket)

    def begin_send(self, version: int) -> list | None:
        """The buckets of ``version`` for one receiver; they are not recycled until ``end_send``."""
        with self._lock:
            buckets = self._held.get(version)
            if buckets is not None:
                self._sending[version] = self._sending.get(version, 0) + 1
            return buckets

    def end_send(self, version: int) -> None:
        with self._lock:
            self._sending[version] -= 1
            if self._sending[version] == 0:
                del self._sending[version]
                if version in self._retired:
                    self._recycle(self._retired.pop(version))

    def buckets_of(self, version: int) -> list | None:
        with self._lock:
            return self._held.get(version)

    def versions(self) -> list[int]:
        with self._lock:
            return sorted(self._held)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _new_array(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, dtype=np.uint8)


def _recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    data = bytearray(nbytes)
    _recv_into_exact(sock, memoryview(data))
    return bytes(data)


def _recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    received = 0
    while received < view.nbytes:
        count = sock.recv_into(view[received:])
        if count == 0:
            raise ConnectionError(f"weight bus: peer closed after {received} of {view.nbytes} bytes")
        received += count


def fetch(
    manifest: WeightManifest,
    into: memoryview,
    timeout_s: float = 60.0,
    on_bucket: Callable[[int], None] | None = None,
) -> int:
    """Pull ``manifest.version`` from its publisher into ``into``; returns the bytes received.

    ``on_bucket(k)`` runs as soon as bucket k is complete (a receiver verifies it while the next one
    arrives). Raises WeightUnavailableError if the publisher no longer holds the version,
    ConnectionError or TimeoutError (socket.timeout) if the transfer breaks or makes no progress for
    ``timeout_s``.
    """
    # The cast view must be released even when the transfer fails: a caller's mmap cannot be
    # closed while views of it exist.
    with memoryview(into).cast("B") as view:
        return _fetch_into(manifest, view, timeout_s, on_bucket)


def _fetch_into(
    manifest: WeightManifest, into: memoryview, timeout_s: float, on_bucket: Callable[[int], None] | None
) -> int:
    host, _, port = manifest.publisher_address.rpartition(":")
    expected = sum(manifest.bucket_nbytes)
    if into.nbytes < expected:
        raise ValueError(f"receive buffer holds {into.nbytes} bytes, version needs {expected}")
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        sock.settimeout(timeout_s)
        sock.sendall(MAGIC + _HEADER.pack(manifest.version))
        (total,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
        if total < 0:
            (length,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
            raise WeightUnavailableError(_recv_exact(sock, length).decode(errors="replace"))
        if total != expected:
            raise ConnectionError(f"publisher sends {total} bytes, manifest says {expected}")
        start = 0
        for index, size in enumerate(manifest.bucket_nbytes):
            with into[start : start + size] as target:
                _recv_into_exact(sock, target)
            start += size
            if on_bucket is not None:
                on_bucket(index)
    return total
