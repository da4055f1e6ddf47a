"""WeightSender: the trainer's side of the tcp weight bus.

Per version: encode + pack bucket by bucket (two-buffer pipeline: the caller's thread packs bucket
k+1 while the sender thread writes bucket k to the disk snapshot) -> hold the buckets on the tcp
publisher -> commit the snapshot -> manifest in Redis (which announces the version). Receivers pull
afterwards, each at its own pace, so ``publish`` never waits on a rollout server.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import redis
import torch

from channels.version_board import VersionBoard
from protos.records import LoraAdapter, WeightManifest
from protos.redis_keys import RedisKeys
from weight_bus import packing
from weight_bus.host_staging import host_array
from weight_bus.pipeline import SendPipeline
from weight_bus.snapshot import SnapshotWriter
from weight_bus.tcp import TcpWeightPublisher

logger = logging.getLogger(__name__)


@dataclass
class PublishStats:
    """Figures of one publish (``weight_bus/*`` metrics)."""

    version: int
    seconds: float
    num_tensors: int
    num_bytes: int
    num_buckets: int


class WeightSender:
    """Publishes versions over tcp (optionally with disk snapshots); see the module docstring."""

    def __init__(
        self,
        client: redis.Redis,
        keys: RedisKeys,
        config,
        transport: str = "tcp",
        recycle: bool = True,
        pinned: bool | None = None,
    ):
        """``pinned``: bucket buffers in page-locked memory (default: when CUDA is there), so device tensors are
        copied into them asynchronously; ``recycle`` hands a dropped version's buffers to later versions."""
        self.client = client
        self.keys = keys
        self.board = VersionBoard(client, keys)
        self.config = config
        self.codec = packing.WireCodec.from_config(config)
        self.bytes_per_bucket = int(config.bucket_mib * 2**20)
        self.transport_name = transport
        pinned = torch.cuda.is_available() if pinned is None else pinned
        self.tcp = TcpWeightPublisher(
            config.host,
            config.port,
            config.keep_versions,
            config.send_timeout_s,
            recycle=recycle,
            new_buffer=functools.partial(host_array, pinned=pinned),
        )
        self.snapshots = SnapshotWriter(config.snapshot_dir, config.keep_snapshots) if config.snapshot_dir else None

    def pack(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]], adapter: LoraAdapter | None = None):
        """Pack one version through the two-buffer pipeline; returns (manifest, bucket buffers). ``adapter``: the
        tensors are that LoRA adapter (PEFT names), which travels as it is (no wire codec)."""
        buckets: list[packing.PackedBucket] = []
        if self.snapshots is not None:
            self.snapshots.begin(version)

        def send(slot: int, bucket: packing.PackedBucket) -> None:
            if self.snapshots is not None:
                self.snapshots.write_bucket(bucket.data)

        codec = packing.RAW if adapter is not None else self.codec
        source = packing.iter_buckets(named_tensors, self.bytes_per_bucket, codec, alloc=self.tcp.allocate)
        try:
            with SendPipeline(send) as pipe:
                while True:
                    slot = pipe.acquire()
                    bucket = next(source, None)
                    if bucket is None:
                        pipe.release(slot)
                        break
                    buckets.append(bucket)
                    pipe.submit(slot, bucket)
        except BaseException:
            if self.snapshots is not None:
                self.snapshots.abort()
            raise
        # An adapter is always fetched over tcp, whatever transport carries full versions.
        transport = "tcp" if adapter is not None else self.transport_name
        manifest = packing.make_manifest(version, buckets, self.tcp.address, transport, adapter)
        return manifest, [bucket.data for bucket in buckets]

    def publish(
        self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]], adapter: LoraAdapter | None = None
    ) -> PublishStats:
        started = time.monotonic()
        manifest, buckets = self.pack(version, named_tensors, adapter)
        self.announce(manifest, buckets)
        stats = PublishStats(
            version, time.monotonic() - started, len(manifest.tensors), packing.total_nbytes(manifest), len(buckets)
        )
        logger.info(
            "weight bus: published v%d (%d tensors, %.1f MiB in %d buckets, %s) in %.2fs",
            version,
            stats.num_tensors,
            stats.num_bytes / 2**20,
            stats.num_buckets,
            "LoRA adapter" if adapter is not None else f"codec {self.codec.name}",
            stats.seconds,
        )
        return stats

    def announce(self, manifest: WeightManifest, buckets: list) -> None:
        """Hold the buckets, commit the snapshot, then announce: receivers find the bytes before the manifest."""
        self.tcp.hold(manifest.version, buckets)
        if self.snapshots is not None:
            self.snapshots.commit(manifest)
        self.board.publish_manifest(manifest)

    def close(self) -> None:
        self.tcp.close()
        if self.snapshots is not None:
            self.snapshots.abort()
