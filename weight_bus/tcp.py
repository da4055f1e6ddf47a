"""TCP transport of the weight bus, for machines without GPUs.

The publisher (trainer side) serves the buckets of its last few versions; each receiver (rollout
server) pulls one version straight into a buffer it owns (``recv_into``: no intermediate copies).
Blocking sockets on threads: the work is pure I/O, the GIL is released during it.

Wire protocol, little-endian: request = MAGIC + int64 version. Reply = int64 total bytes followed by
the buckets end to end, or int64 -1 + int64 length + utf-8 error message.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import struct
import threading

from protos.records import WeightManifest

logger = logging.getLogger(__name__)

MAGIC = b"FLRLWB01"
_HEADER = struct.Struct("<q")


class WeightUnavailableError(RuntimeError):
    """The publisher no longer (or not yet) holds the requested version."""


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        publisher: TcpWeightPublisher = self.server.publisher  # type: ignore[attr-defined]
        sock: socket.socket = self.request
        sock.settimeout(publisher.timeout_s)
        request = _recv_exact(sock, len(MAGIC) + _HEADER.size)
        if request[: len(MAGIC)] != MAGIC:
            logger.warning("weight bus: rejected a request without the protocol magic")
            return
        (version,) = _HEADER.unpack(request[len(MAGIC) :])
        buckets = publisher.buckets_of(version)
        if buckets is None:
            message = f"version {version} is not held (held: {publisher.versions()})".encode()
            sock.sendall(_HEADER.pack(-1) + _HEADER.pack(len(message)) + message)
            return
        sock.sendall(_HEADER.pack(sum(len(b) for b in buckets)))
        for bucket in buckets:
            sock.sendall(memoryview(bucket))


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class TcpWeightPublisher:
    """Serves published versions to receivers on ``host:port`` from a background thread."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, keep_versions: int = 2, timeout_s: float = 60.0):
        self.keep_versions = keep_versions
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._held: dict[int, list[bytearray]] = {}
        self._server = _Server((host, port), _Handler)
        self._server.publisher = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._server.serve_forever, name="weight-bus-tcp", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{host}:{port}"

    def hold(self, version: int, buckets: list[bytearray]) -> None:
        """Make ``version`` fetchable; drops versions beyond ``keep_versions``."""
        with self._lock:
            self._held[version] = buckets
            for old in sorted(self._held)[: -self.keep_versions]:
                del self._held[old]

    def buckets_of(self, version: int) -> list[bytearray] | None:
        with self._lock:
            return self._held.get(version)

    def versions(self) -> list[int]:
        with self._lock:
            return sorted(self._held)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


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


def fetch(manifest: WeightManifest, into: memoryview, timeout_s: float = 60.0) -> int:
    """Pull ``manifest.version`` from its publisher into ``into``; returns the bytes received.

    Raises WeightUnavailableError if the publisher no longer holds it, ConnectionError or
    TimeoutError (socket.timeout) if the transfer breaks or stalls longer than ``timeout_s``.
    """
    # The cast view must be released even when the transfer fails: a caller's mmap cannot be
    # closed while views of it exist.
    with memoryview(into).cast("B") as view:
        return _fetch_into(manifest, view, timeout_s)


def _fetch_into(manifest: WeightManifest, into: memoryview, timeout_s: float) -> int:
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
        with into[:total] as target:
            _recv_into_exact(sock, target)
    return total
