"""Published versions on disk, so a receiver can load a version while its publisher is unreachable.

Layout under ``snapshot_dir``::

    v000000000007/manifest.msgpack   the WeightManifest record (protos.records.encode)
    v000000000007/buckets.bin        all buckets end to end, exactly as a tcp fetch fills a buffer

A version is written into a hidden temporary directory and renamed into place only when complete
(rename is atomic on one filesystem), so a reader never sees half a snapshot. The writer keeps the
newest ``keep`` snapshots. Readers refuse a snapshot whose manifest differs from the one they were
asked to load, and the caller verifies checksums as for any other transfer.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from protos.records import WeightManifest, decode_manifest, encode
from weight_bus import packing

logger = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.msgpack"
BUCKETS_FILE = "buckets.bin"


class SnapshotMissingError(FileNotFoundError):
    """The snapshot directory holds no (matching) snapshot of the requested version.

    An OSError, like the publisher being unreachable: the version exists, its bytes cannot be had.
    """


def version_dir(snapshot_dir: str | Path, version: int) -> Path:
    return Path(snapshot_dir) / f"v{version:012d}"


class SnapshotWriter:
    """Writes one version at a time: ``begin``, ``write_bucket`` for each bucket in order, ``commit``."""

    def __init__(self, snapshot_dir: str | Path, keep: int = 2):
        if keep < 1:
            raise ValueError(f"weight_bus.keep_snapshots must be >= 1, got {keep}")
        self.snapshot_dir = Path(snapshot_dir)
        self.keep = keep
        self._tmp: Path | None = None
        self._file = None

    def begin(self, version: int) -> None:
        self.abort()
        self.snapshot_dir.mkdir(parents=True, exist_ok=True)
        self._tmp = Path(tempfile.mkdtemp(prefix=f".v{version}-", dir=self.snapshot_dir))
        self._file = open(self._tmp / BUCKETS_FILE, "wb")

    def write_bucket(self, data) -> None:
        if self._file is None:
            raise RuntimeError("SnapshotWriter.write_bucket before begin")
        self._file.write(memoryview(data).cast("B"))

    def commit(self, manifest: WeightManifest) -> Path:
        """Make the snapshot visible under its version (atomic rename), then drop old ones."""
        if self._file is None or self._tmp is None:
            raise RuntimeError("SnapshotWriter.commit before begin")
        written = self._file.tell()
        if written != packing.total_nbytes(manifest):
            raise ValueError(
                f"snapshot of v{manifest.version}: {written} bytes written, manifest says "
                f"{packing.total_nbytes(manifest)}"
            )
        # Durable before visible: a reader after a crash finds a whole snapshot or none.
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        (self._tmp / MANIFEST_FILE).write_bytes(encode(manifest))
        target = version_dir(self.snapshot_dir, manifest.version)
        if target.exists():  # a republished version (trainer restart) replaces the old one
            shutil.rmtree(target)
        os.rename(self._tmp, target)
        self._tmp = None
        self._prune()
        return target

    def abort(self) -> None:
        """Drop a begun, uncommitted snapshot."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def _prune(self) -> None:
        for version in versions(self.snapshot_dir)[: -self.keep]:
            shutil.rmtree(version_dir(self.snapshot_dir, version), ignore_errors=True)


def versions(snapshot_dir: str | Path) -> list[int]:
    """Committed snapshot versions, oldest first."""
    root = Path(snapshot_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        if child.name.startswith("v") and child.name[1:].isdigit() and (child / MANIFEST_FILE).is_file():
            found.append(int(child.name[1:]))
    return sorted(found)


def read_manifest(snapshot_dir: str | Path, version: int) -> WeightManifest | None:
    path = version_dir(snapshot_dir, version) / MANIFEST_FILE
    try:
        return decode_manifest(path.read_bytes())
    except FileNotFoundError:
        return None


def load_into(snapshot_dir: str | Path, manifest: WeightManifest, into: memoryview) -> int:
    """Read the snapshot of ``manifest.version`` into ``into``; returns the bytes read.

    Raises SnapshotMissingError when there is no snapshot of that version or it was written for a
    different manifest (other tensors, checksums or bucket sizes).
    """
    stored = read_manifest(snapshot_dir, manifest.version)
    if stored is None:
        raise SnapshotMissingError(f"no snapshot of v{manifest.version} in {snapshot_dir}")
    if stored.tensors != manifest.tensors or stored.bucket_nbytes != manifest.bucket_nbytes:
        raise SnapshotMissingError(
            f"the snapshot of v{manifest.version} in {snapshot_dir} was written for another manifest"
        )
    size = packing.total_nbytes(manifest)
    with memoryview(into).cast("B") as view:
        if view.nbytes < size:
            raise ValueError(f"receive buffer holds {view.nbytes} bytes, version needs {size}")
        with open(version_dir(snapshot_dir, manifest.version) / BUCKETS_FILE, "rb") as source:
            got = 0
            while got < size:
                with view[got:size] as target:
                    count = source.readinto(target)
                if not count:
                    raise SnapshotMissingError(f"snapshot of v{manifest.version} is truncated at {got} of {size} bytes")
                got += count
    return size
