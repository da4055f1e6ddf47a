"""WeightPublisher: the trainer's side of the weight bus.

A thin adapter: ``weight_bus.sender.WeightSender`` (tcp: pack -> snapshot -> hold -> manifest in Redis)
or ``weight_bus.nccl.NcclWeightPublisher`` (GPU broadcast to the rollout ranks, plus the same tcp hold
for late receivers), chosen by ``weight_bus.transport``.
"""

from __future__ import annotations

import logging

import redis

from protos.config import WeightBusConfig
from protos.redis_keys import RedisKeys
from weight_bus.sender import WeightSender

logger = logging.getLogger(__name__)


class WeightPublisher:
    def __init__(self, client: redis.Redis, keys: RedisKeys, config: WeightBusConfig):
        self.client = client
        self.keys = keys
        self.config = config
        if config.transport == "nccl":
            from weight_bus.nccl import NcclWeightPublisher  # imports cupy lazily, on GPU machines only

            self.sender = NcclWeightPublisher(client, keys, config)
        else:
            self.sender = WeightSender(client, keys, config)
        self.num_published = 0
        self.last_stats = None

    @property
    def transport(self):
        """The tcp publisher holding each version's buckets (late receivers fetch from it)."""
        return self.sender.tcp

    def publish(self, version: int, named_tensors) -> float:
        """Publish one version; returns the seconds it took (tcp receivers pull asynchronously)."""
        self.last_stats = self.sender.publish(version, named_tensors)
        self.num_published += 1
        return self.last_stats.seconds

    def close(self) -> None:
        self.sender.close()
