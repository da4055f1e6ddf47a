"""WeightPublisher: the trainer's side of the weight bus.

A thin adapter: ``weight_bus.sender.WeightSender`` (tcp: pack -> snapshot -> hold -> manifest in Redis),
``weight_bus.nccl.NcclWeightPublisher`` (GPU broadcast to the rollout ranks, plus the same tcp hold for late
receivers) or ``weight_bus.ipc.IpcWeightPublisher`` (device buckets shared with a colocated engine by CUDA IPC,
plus the tcp hold), chosen by ``weight_bus.transport``.
"""

from __future__ import annotations

import logging

import redis
import torch

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
        elif config.transport == "ipc" and torch.cuda.is_available():
            from weight_bus.ipc import IpcWeightPublisher

            self.sender = IpcWeightPublisher(client, keys, config)
        else:
            if config.transport == "ipc":
                logger.warning("weight_bus.transport='ipc' needs CUDA at the trainer; publishing over tcp")
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
