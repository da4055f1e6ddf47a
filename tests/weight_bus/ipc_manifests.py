"""What the ipc publisher announces before its host mirror has checksummed a version, built from a packed one."""

from __future__ import annotations

import msgspec

from protos.records import WeightManifest


def announced_before_checksums(manifest: WeightManifest, publisher_address: str) -> WeightManifest:
    """``manifest`` as ``IpcWeightPublisher.publish`` announces it: checksums 0, ``checksummed=False``, transport
    'ipc', the tcp address its mirror will serve the bytes from."""
    return msgspec.structs.replace(
        manifest,
        tensors=[msgspec.structs.replace(e, checksum=0) for e in manifest.tensors],
        publisher_address=publisher_address,
        transport="ipc",
        checksummed=False,
    )
