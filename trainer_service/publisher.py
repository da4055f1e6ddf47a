"""WeightPublisher: the trainer's side of the weight bus (pack -> hold on tcp -> manifest in Redis)."""

from __future__ import annotations

import logging
import time

import redis

from protos.config import WeightBusConfig
from protos.redis_keys import RedisKeys
from weight_bus import packing, rendezvous
from weight_bus.tcp import TcpWeightPublisher

logger = logging.getLogger(__name__)


class WeightPublisher:
    def __init__(self, client: redis.Redis, keys: RedisKeys, config: WeightBusConfig):
        self.client = client
        self.keys = keys
        self.config = config
        self.transport = TcpWeightPublisher(config.host, config.port, config.keep_versions, config.fetch_timeout_s)
        self.num_published = 0

    def publish(self, version: int, named_tensors) -> float:
        """Publish one version; returns the seconds it took (receivers pull asynchronously)."""
        started = time.monotonic()
        manifest, buckets = packing.pack(
            named_tensors, version, int(self.config.bucket_mib * 2**20), self.transport.address, "tcp"
        )
        self.transport.hold(version, buckets)
        rendezvous.publish_manifest(self.client, self.keys, manifest)
        self.num_published += 1
        return time.monotonic() - started

    def close(self) -> None:
        self.transport.close()
