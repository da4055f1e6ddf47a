"""WeightFollower: keeps a rollout server on the trainer's latest published policy version.

Sequence per version (docs/architecture.md): receive manifest + buckets into staging -> verify
checksums -> pause(keep) -> load -> label v -> resume -> report v to Redis. A version that cannot be
received or verified is reported STALE and the server stays on its old version, never half-loaded.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import time

import redis.asyncio as aioredis

from protos.config import WeightBusConfig
from protos.records import ReportStatus, encode
from protos.redis_keys import RedisKeys
from rollout_service.engine import RolloutEngine
from weight_bus import packing, rendezvous, tcp

logger = logging.getLogger(__name__)

STAGING_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"


class WeightFollower:
    """Follows the weight announcements of one run and applies new versions to ``engine``."""

    def __init__(
        self,
        engine: RolloutEngine,
        client: aioredis.Redis,
        keys: RedisKeys,
        config: WeightBusConfig,
        address: str,
    ):
        self.engine = engine
        self.client = client
        self.keys = keys
        self.config = config
        self.address = address
        self.last_update_s = 0.0
        # The announcement follower and UpdateWeights calls may race for the same version.
        self._lock = asyncio.Lock()

    async def report(self, status: ReportStatus = ReportStatus.OK, message: str = "") -> None:
        await rendezvous.report_version(
            self.client, self.keys, self.engine.server_id, self.address,
            self.engine.policy_version, status, message,
        )

    async def update_to(self, version: int) -> int:
        """Receive and commit ``version`` (0 = latest); returns the version in force afterwards."""
        async with self._lock:
            return await self._update_locked(version)

    async def _update_locked(self, version: int) -> int:
        if version <= 0:
            version = await rendezvous.latest_version(self.client, self.keys)
        if version <= self.engine.policy_version:
            return self.engine.policy_version
        manifest = await rendezvous.get_manifest(self.client, self.keys, version)
        if manifest is None:
            raise LookupError(f"no manifest for policy version {version} in Redis")
        started = time.monotonic()
        path = os.path.join(STAGING_DIR, f"fleetrl-{self.engine.server_id}-v{version}")
        try:
            await asyncio.to_thread(self._receive, manifest, path)
            paused_s = await self.engine.commit_weights(version, path, encode(manifest))
        finally:
            if os.path.exists(path):
                os.unlink(path)
        self.last_update_s = time.monotonic() - started
        logger.info(
            "server %s policy_version=%d committed in %.2fs (paused %.2fs)",
            self.engine.server_id, version, self.last_update_s, paused_s,
        )
        await self.report()
        return version

    def _receive(self, manifest, path: str) -> None:
        size = packing.total_nbytes(manifest)
        with open(path, "wb+") as staging:
            staging.truncate(size)
            if size == 0:
                return
            with mmap.mmap(staging.fileno(), size) as buffer:
                view = memoryview(buffer)
                try:
                    tcp.fetch(manifest, view, timeout_s=self.config.fetch_timeout_s)
                    packing.verify(manifest, view)
                finally:
                    view.release()

    async def run(self, stop: asyncio.Event) -> None:
        """Catch up to the latest version, then follow announcements until ``stop`` is set."""
        last_id = "$"
        await self._try_update(0)
        while not stop.is_set():
            last_id, announced = await rendezvous.wait_for_announcement(
                self.client, self.keys, last_id, timeout_s=1.0
            )
            if announced is not None:
                await self._try_update(0)

    async def _try_update(self, version: int) -> None:
        try:
            await self.update_to(version)
        except (LookupError, OSError, ValueError, tcp.WeightUnavailableError) as error:
            # Stay on the old version and say so; the next announcement retries.
            logger.warning("server %s stays on v%d: %s", self.engine.server_id, self.engine.policy_version, error)
            await self.report(ReportStatus.STALE, str(error))
