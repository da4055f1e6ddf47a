"""The rollout side of the weight bus: receive a version into a buffer and verify it.

Bytes come from the publisher (tcp) and, when it is unreachable or no longer holds the version, from
the last published snapshot on disk. Bucket k is verified on a worker thread while bucket k+1 is still
arriving, so checking checksums adds little to the transfer. A checksum mismatch is never papered over
with the snapshot: the version is refused and the caller keeps its old one.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

from protos.records import WeightManifest
from weight_bus import packing, snapshot, tcp

logger = logging.getLogger(__name__)

# Errors after which the snapshot on disk is tried: the publisher is gone, stalled or dropped the version.
_PUBLISHER_UNREACHABLE = (OSError, tcp.WeightUnavailableError)


def receive_into(manifest: WeightManifest, into: memoryview, timeout_s: float, snapshot_dir: str = "") -> str:
    """Fill ``into`` with ``manifest``'s buckets and verify them; returns "publisher" or "snapshot".

    Raises ChecksumError on corrupted bytes, SnapshotMissingError when the publisher is unreachable
    and no matching snapshot exists, and the transport's error when there is no snapshot directory.
    """
    try:
        _fetch_verified(manifest, into, timeout_s)
        return "publisher"
    except _PUBLISHER_UNREACHABLE as error:
        if not snapshot_dir:
            raise
        logger.warning(
            "weight bus: v%d unavailable from publisher %s (%s); loading the snapshot in %s",
            manifest.version,
            manifest.publisher_address,
            error,
            snapshot_dir,
        )
    snapshot.load_into(snapshot_dir, manifest, into)
    packing.verify(manifest, into)
    return "snapshot"


def _fetch_verified(manifest: WeightManifest, into: memoryview, timeout_s: float) -> None:
    checks: list[Future] = []
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-bus-verify") as pool:

        def on_bucket(index: int) -> None:
            checks.append(pool.submit(packing.verify, manifest, into, index))

        tcp.fetch(manifest, into, timeout_s=timeout_s, on_bucket=on_bucket)
        for check in checks:
            check.result()


def resolve_manifest(manifest: WeightManifest | None, version: int, snapshot_dir: str) -> WeightManifest | None:
    """The manifest from Redis, or (when Redis lost it) the one stored with the snapshot of ``version``."""
    if manifest is not None or not snapshot_dir:
        return manifest
    return snapshot.read_manifest(snapshot_dir, version)


def latest_snapshot_version(snapshot_dir: str) -> int:
    """The newest version with a snapshot in ``snapshot_dir`` (0 when off or empty)."""
    found = snapshot.versions(snapshot_dir) if snapshot_dir else []
    return found[-1] if found else 0


def check_receive_mode(receive_mode: str, serves_mxfp8: bool, cuda_available: bool) -> None:
    """Refuse a receive mode the engine cannot honour, with the fix in the message.

    vLLM 0.32 on CPU has no MXFP8 linear kernel (``init_mxfp8_linear_kernel`` lists none for the CPU
    platform; starting an engine on an MXFP8 checkpoint fails with "Failed to find a kernel that can
    implement the MXFP8 linear layer"), so 'mxfp8' is a GPU-only mode.
    """
    if receive_mode == "mxfp8" and not cuda_available:
        raise ValueError(
            "weight_bus.receive_mode='mxfp8' needs a GPU engine: vLLM on CPU cannot serve an MXFP8 checkpoint "
            "(no MXFP8 linear kernel on the CPU platform); use weight_bus.receive_mode='dequantize'"
        )
    if receive_mode == "mxfp8" and not serves_mxfp8:
        raise ValueError(
            "weight_bus.receive_mode='mxfp8' needs the engine to serve an MXFP8 checkpoint (quantization "
            "'modelopt_mxfp8' or compressed-tensors MXFP8); this one serves unquantized weights: use "
            "weight_bus.receive_mode='dequantize'"
        )
    if receive_mode == "dequantize" and serves_mxfp8:
        raise ValueError(
            "the engine serves an MXFP8 checkpoint, which loads (q, scale) pairs only: set "
            "weight_bus.receive_mode='mxfp8' and weight_bus.codec='mxfp8'"
        )
