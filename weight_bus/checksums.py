"""crc32 of the weight bus's entries on a thread pool, so checksumming a version scales with cores.

One thread runs ``zlib.crc32`` at about 2.3 GB/s, which made checksums the publisher's and the receiver's slowest
part on a GPU machine. ``zlib.crc32`` releases the GIL for buffers over 5 KiB, so threads run it in parallel. An entry
larger than ``CHUNK_BYTES`` is cut into chunks whose crcs are joined with ``crc32_combine`` (zlib's algorithm), so a
single large tensor spreads over the cores too. Every value equals ``zlib.crc32`` of the entry's whole bytes: the
manifest's checksums (``TensorEntry.checksum``) are the same on the wire as before.
"""

from __future__ import annotations

import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np

CHUNK_BYTES = 8 << 20  # large enough that a task's overhead is noise, small enough to spread one big tensor
_POLY = 0xEDB88320  # crc32's polynomial, bit-reflected as zlib uses it


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the crc polynomial, in zlib's reflected bit order (zlib's ``multmodp``; a must be nonzero)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    table = [1 << 30]  # x^1
    for _ in range(31):
        table.append(_multmodp(table[-1], table[-1]))  # x^(2^n)
    return table


_X2N = _x2n_table()


def _x2nmodp(n: int, k: int) -> int:
    """x^(n * 2^k) modulo the polynomial (zlib's ``x2nmodp``)."""
    p = 1 << 31  # x^0
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32 of A + B from crc32(A), crc32(B) and len(B) in bytes (zlib's ``crc32_combine``, which Python lacks)."""
    return _multmodp(_x2nmodp(len2, 3), crc1) ^ crc2


def _as_bytes(buffer) -> memoryview:
    return memoryview(buffer).cast("B") if not isinstance(buffer, np.ndarray) else memoryview(buffer.view(np.uint8))


def _pieces(buffers: list, chunk_bytes: int) -> list[tuple[int, memoryview]]:
    """(entry index, chunk) in order; every entry has at least one chunk, an empty one has one empty chunk."""
    pieces = []
    for index, buffer in enumerate(buffers):
        view = _as_bytes(buffer)
        pieces.extend(
            (index, view[start : start + chunk_bytes]) for start in range(0, max(view.nbytes, 1), chunk_bytes)
        )
    return pieces


def _jobs(pieces: list[tuple[int, memoryview]], chunk_bytes: int) -> list[list[memoryview]]:
    """Consecutive chunks grouped into tasks of about ``chunk_bytes``: small tensors share a task."""
    jobs, current, size = [], [], 0
    for _, view in pieces:
        current.append(view)
        size += view.nbytes
        if size >= chunk_bytes:
            jobs.append(current)
            current, size = [], 0
    if current:
        jobs.append(current)
    return jobs


def _crcs(job: list[memoryview]) -> list[int]:
    return [zlib.crc32(view) for view in job]


class ChecksumPool:
    """crc32 of many buffers at once on ``num_threads`` threads (1: sequentially in the caller's thread)."""

    def __init__(self, num_threads: int | None = None, chunk_bytes: int = CHUNK_BYTES):
        self.num_threads = num_threads or min(16, os.cpu_count() or 1)
        self.chunk_bytes = chunk_bytes
        self._executor = (
            ThreadPoolExecutor(self.num_threads, thread_name_prefix="weight-bus-crc") if self.num_threads > 1 else None
        )

    def crc32_many(self, buffers: list) -> list[int]:
        """``[zlib.crc32(b) for b in buffers]``, computed chunk by chunk on the pool; buffers are bytes-like."""
        pieces = _pieces(buffers, self.chunk_bytes)
        jobs = _jobs(pieces, self.chunk_bytes)
        if self._executor is None or len(jobs) < 2:
            results = [_crcs(job) for job in jobs]
        else:
            results = list(self._executor.map(_crcs, jobs))
        crcs, seen = [0] * len(buffers), [False] * len(buffers)
        chunk_crcs = (crc for job_crcs in results for crc in job_crcs)
        for (index, view), crc in zip(pieces, chunk_crcs, strict=True):
            crcs[index] = crc32_combine(crcs[index], crc, view.nbytes) if seen[index] else crc
            seen[index] = True
        return crcs

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)


_shared: ChecksumPool | None = None
_shared_lock = threading.Lock()


def shared_pool() -> ChecksumPool:
    """The process's pool (publisher and receivers share its threads); made on first use."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = ChecksumPool()
        return _shared


def configure(num_threads: int) -> None:
    """Replace the shared pool by one of ``num_threads`` (1: sequential), while no checksum is in flight; benchmarks
    compare thread counts in one run."""
    global _shared
    with _shared_lock:
        previous, _shared = _shared, ChecksumPool(num_threads)
    if previous is not None:
        previous.close()


def crc32_many(buffers: list) -> list[int]:
    """``zlib.crc32`` of each buffer, on the shared pool."""
    return shared_pool().crc32_many(buffers)
