"""FleetWatcher: keeps the scheduler's view of the fleet and of the trainer's version current.

The fleet view is the servers' own version reports in Redis (a server is on version v only after it
reported v) plus gRPC health checks.
"""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from coordinator.scheduler import Scheduler
from protos.redis_keys import RedisKeys
from weight_bus import rendezvous

logger = logging.getLogger(__name__)


class FleetWatcher:
    def __init__(self, scheduler: Scheduler, client: aioredis.Redis, keys: RedisKeys, interval_s: float = 0.2):
        self.scheduler = scheduler
        self.client = client
        self.keys = keys
        self.interval_s = interval_s

    async def refresh(self) -> None:
        scheduler = self.scheduler
        scheduler.trainer_version = await rendezvous.latest_version(self.client, self.keys)
        reports = await rendezvous.fleet_reports(self.client, self.keys)
        by_address = {report.address: report for report in reports.values()}
        for client in scheduler.clients:
            report = by_address.get(client.address)
            if report is not None and report.policy_version != client.policy_version:
                client.policy_version = report.policy_version
        scheduler.notify_fleet_changed()

    async def run(self, stop: asyncio.Event) -> None:
        ticks = 0
        while not stop.is_set():
            try:
                await self.refresh()
            except (RedisConnectionError, OSError) as error:
                logger.warning("fleet refresh failed (Redis unreachable?): %s", error)
            if ticks % 10 == 0:
                for client in self.scheduler.clients:
                    was_healthy = client.healthy
                    if not await client.check_health() and was_healthy:
                        logger.warning("rollout server %s is unhealthy", client.address)
            ticks += 1
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.interval_s)
            except TimeoutError:
                pass
