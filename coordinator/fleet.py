"""Fleet: the rollout servers the coordinator routes to; FleetWatcher keeps its view current.

Routing is least-loaded among the healthy servers a caller accepts (training: version >= the group's
floor; eval: version == the pinned version). A failed call is retried on another server, and every
retry is counted as a re-dispatch. The fleet view is the servers' own version reports in Redis (a
server is on version v only after it reported v) plus gRPC health checks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import redis.asyncio as aioredis

from channels.retry import UNREACHABLE
from channels.version_board import AsyncVersionBoard
from coordinator.rollout_client import RolloutClient, RolloutFailed, SampleResult
from protos.config import SamplingConfig
from protos.redis_keys import RedisKeys

logger = logging.getLogger(__name__)


class NoServerAvailable(RuntimeError):
    """No healthy server that the caller accepts appeared within the wait."""


class Fleet:
    """The routable servers; ``retired`` ones (removed by an operator) only finish their open calls."""

    def __init__(self, clients: list[RolloutClient]):
        self.clients = list(clients)
        self.retired: list[RolloutClient] = []
        self.redispatches = 0
        self._changed = asyncio.Event()

    def notify_changed(self) -> None:
        self._changed.set()

    def find(self, address: str) -> RolloutClient | None:
        return next((c for c in self.clients if c.address == address), None)

    async def add(self, address: str, timeout_s: float = 10.0) -> RolloutClient:
        """Start routing to ``address`` once it answers a health check and ServerInfo."""
        if self.find(address) is not None:
            raise ValueError(f"rollout server {address} is already in the fleet")
        client = RolloutClient(address)
        if not await client.check_health(timeout_s=timeout_s):
            await client.close()
            raise RolloutFailed(f"rollout server {address} is not healthy (gRPC health check within {timeout_s}s)")
        await client.info(timeout_s=timeout_s)
        self.clients.append(client)
        self.notify_changed()
        logger.info("rollout server %s (%s, v%d) added", address, client.server_id, client.policy_version)
        return client

    def remove(self, address: str) -> RolloutClient:
        """Stop sending new calls to ``address``; its open calls finish."""
        client = self.find(address)
        if client is None:
            raise KeyError(f"rollout server {address} is not in the fleet ({[c.address for c in self.clients]})")
        if len(self.clients) == 1:
            raise ValueError(f"{address} is the last rollout server; add another before removing it")
        self.clients.remove(client)
        self.retired.append(client)
        logger.info("rollout server %s removed (%d calls still open there)", address, client.inflight)
        return client

    async def pick(
        self, accept: Callable[[RolloutClient], bool], exclude: set[str], timeout_s: float, what: str
    ) -> RolloutClient:
        """Least-loaded healthy accepted server, preferring ones not in ``exclude``; waits up to ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            eligible = [c for c in self.clients if c.healthy and accept(c)]
            if eligible:
                fresh = [c for c in eligible if c.address not in exclude]
                return min(fresh or eligible, key=lambda c: c.inflight)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise NoServerAvailable(f"no healthy rollout server {what} within {timeout_s}s")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=min(remaining, 1.0))
            except TimeoutError:
                pass

    async def generate(
        self,
        prompt_token_ids: list[int],
        n: int,
        sampling: SamplingConfig,
        accept: Callable[[RolloutClient], bool],
        what: str,
        request_id: str,
        timeout_s: float,
        max_attempts: int,
    ) -> tuple[list[SampleResult], RolloutClient]:
        """One Generate call, retried on another server when a server fails (each retry counted)."""
        tried: set[str] = set()
        errors = []
        for attempt in range(1, max_attempts + 1):
            client = await self.pick(accept, tried, timeout_s, what)
            tried.add(client.address)
            try:
                results = await client.generate(
                    prompt_token_ids, n, sampling, timeout_s, request_id=f"{request_id}-a{attempt}"
                )
                return results, client
            except RolloutFailed as error:
                errors.append(str(error))
                self.redispatches += 1
                logger.warning("%s attempt %d failed (%s); re-dispatching", request_id, attempt, error)
                self.notify_changed()
        raise RolloutFailed(f"{request_id} failed on {max_attempts} attempts: {errors}")

    async def close(self) -> None:
        for client in self.clients + self.retired:
            await client.close()


class FleetWatcher:
    """Follows the trainer's version and the servers' reports in Redis, and health-checks the servers."""

    def __init__(
        self,
        fleet: Fleet,
        on_version: Callable[[int], None],
        client: aioredis.Redis,
        keys: RedisKeys,
        interval_s: float = 0.2,
        on_version_offset: Callable[[int], None] | None = None,
    ):
        self.fleet = fleet
        self.on_version = on_version
        self.on_version_offset = on_version_offset  # (the trainer's version - steps) -> None
        self.client = client
        self.keys = keys
        self.board = AsyncVersionBoard(client, keys)
        self.interval_s = interval_s

    async def refresh(self) -> None:
        version, offset = await self.board.version_and_offset()
        if self.on_version_offset is not None:  # first: the shift must be in place before the new version counts
            self.on_version_offset(offset)
        self.on_version(version)
        reports = await self.board.fleet_reports()
        by_address = {report.address: report for report in reports.values()}
        for client in self.fleet.clients:
            report = by_address.get(client.address)
            if report is not None and report.policy_version != client.policy_version:
                client.policy_version = report.policy_version
        self.fleet.notify_changed()

    async def check_health(self) -> None:
        for client in list(self.fleet.clients):
            was_healthy = client.healthy
            if not await client.check_health() and was_healthy:
                logger.warning("rollout server %s is unhealthy", client.address)
            elif client.healthy and not was_healthy:
                logger.info("rollout server %s is healthy again", client.address)
                self.fleet.notify_changed()

    async def run(self, stop: asyncio.Event) -> None:
        """Refresh as soon as a version is announced or a server reports (``AsyncVersionBoard.wait_for_change``),
        and at least every ``interval_s``; health-check the servers every ``10 * interval_s``.

        Waking on the reports matters on-policy (max_staleness 0): a step's groups may go only to a server on the
        new version, and a poll would leave the servers idle for up to ``interval_s`` after they loaded it."""
        last_ids: dict[str, str] | None = None
        next_health_check = 0.0
        while not stop.is_set():
            try:
                last_ids = last_ids or await self.board.last_change_ids()  # before the refresh: no report is missed
                await self.refresh()
            except UNREACHABLE as error:  # periodic: the next tick is the retry
                logger.warning("fleet refresh skipped, Redis unreachable: %s", error)
            if time.monotonic() >= next_health_check:
                await self.check_health()
                next_health_check = time.monotonic() + 10 * self.interval_s
            last_ids = await self._wait_for_change(last_ids, stop)

    async def _wait_for_change(self, last_ids: dict[str, str] | None, stop: asyncio.Event) -> dict[str, str] | None:
        """Until a change after ``last_ids``, ``interval_s``, or ``stop``; returns the ids to wait after next."""
        if last_ids is not None:
            try:
                return await self.board.wait_for_change(last_ids, self.interval_s)
            except UNREACHABLE as error:
                logger.warning("waiting for fleet changes failed, Redis unreachable: %s", error)
        try:
            await asyncio.wait_for(stop.wait(), timeout=self.interval_s)
        except TimeoutError:
            pass
        return last_ids
