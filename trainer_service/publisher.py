"""WeightPublisher: the trainer's side of the weight bus.

A thin adapter: ``weight_bus.sender.WeightSender`` (tcp: pack -> snapshot -> hold -> manifest in Redis),
``weight_bus.nccl.NcclWeightPublisher`` (GPU broadcast to the rollout ranks, plus the same tcp hold for late
receivers) or ``weight_bus.ipc.IpcWeightPublisher`` (device buckets shared with a colocated engine by CUDA IPC,
plus the tcp hold), chosen by ``weight_bus.transport``.

LoRA adapters (``trainer.lora.sync='adapters'``) always take the tcp publisher (the nccl and ipc ones hold theirs),
staged through pinned host memory on a GPU (``weight_bus.host_staging``): a few percent of the weights' bytes,
fetched by every server into its LoRA slot.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import redis
import torch

from protos.config import WeightBusConfig
from protos.records import LoraAdapter
from protos.redis_keys import RedisKeys
from weight_bus.host_staging import PinnedHostStaging
from weight_bus.sender import WeightSender

logger = logging.getLogger(__name__)


def policy_update(backend) -> tuple[Iterator[tuple[str, torch.Tensor]], LoraAdapter | None]:
    """What one version publishes: the backend's HF weights (merged adapted layers under LoRA), or its adapters and
    their record under ``trainer.lora.sync='adapters'``. Both are collectives every rank iterates."""
    if backend.config.lora.sync == "adapters":
        return backend.export_adapter_weights(), backend.adapter_record()
    return backend.export_hf_weights(), None


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
        self.staging = PinnedHostStaging()
        self.num_published = 0
        self.last_stats = None

    @property
    def transport(self):
        """The tcp publisher holding each version's buckets (late receivers fetch from it)."""
        return self.sender.tcp

    @property
    def tcp_sender(self) -> WeightSender:
        """The tcp ``WeightSender`` (the nccl and ipc publishers' own, for late receivers and adapters)."""
        return self.sender if isinstance(self.sender, WeightSender) else self.sender.fallback

    def publish(self, version: int, named_tensors, adapter: LoraAdapter | None = None) -> float:
        """Publish one version; returns the seconds it took (tcp receivers pull asynchronously). ``adapter``: the
        tensors are that LoRA adapter, staged through pinned host memory and published over tcp."""
        if adapter is None:
            self.last_stats = self.sender.publish(version, named_tensors)
        else:
            started = time.monotonic()
            staged = self.staging.stage(named_tensors)  # the export runs here (a collective), then the copies
            self.last_stats = self.tcp_sender.publish(version, staged, adapter)
            self.last_stats.seconds = time.monotonic() - started
        self.num_published += 1
        return self.last_stats.seconds

    def close(self) -> None:
        self.sender.close()
