"""Fleet: the rollout servers the coordinator routes to; FleetWatcher keeps its view current.

Routing is least-loaded among the healthy servers a caller accepts (training: version >= the group's
floor; eval: version == the pinned version). A failed call is retried on another server, and every
retry is counted as a re-dispatch. The fleet view is the servers' own version reports in Redis (a
server is on version v only after it reported v) plus gRPC health: pushed by each server on a Watch stream
(``health_watch.py``), and checked by a periodic sweep where no stream vouches for a server.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import redis.asyncio as aioredis

from channels.retry import UNREACHABLE
from channels.version_board import AsyncVersionBoard
from coordinator.health_watch import HealthWatches
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

    async def served_info(self):
        """``ServerInfo`` of a healthy server (else the first): every server serves the run's one model."""
        server = next((c for c in self.clients if c.healthy), self.clients[0])
        return server, await server.info()

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
        if self.find(address) is not None:  # added meanwhile (an operator's add racing discovery)
            await client.close()
            raise ValueError(f"rollout server {address} is already in the fleet")
        self.clients.append(client)
        self.notify_changed()
        logger.info("rollout server %s (%s, v%d) added", address, client.server_id, client.policy_version)
        return client

    def remove(self, address: str, keep_one: bool = True) -> RolloutClient:
        """Stop sending new calls to ``address``; its open calls finish. ``keep_one``: refuse to remove the last
        server (an operator's remove; discovery drops a dead last server and waits for the next to register)."""
        client = self.find(address)
        if client is None:
            raise KeyError(f"rollout server {address} is not in the fleet ({[c.address for c in self.clients]})")
        if keep_one and len(self.clients) == 1:
            raise ValueError(f"{address} is the last rollout server; add another before removing it")
        self.clients.remove(client)
        self.retired.append(client)
        logger.info("rollout server %s removed (%d calls still open there)", address, client.inflight)
        return client

    def pick_now(self, accept: Callable[[RolloutClient], bool], exclude: set[str]) -> RolloutClient | None:
        """``pick`` without waiting: None when no healthy server is accepted now.

        One pass that stops at the first idle accepted server outside ``exclude``: the same choice as the minimum over
        all of them (the first least-loaded in fleet order), without calling ``accept`` on every server of a large,
        mostly idle fleet (at 256 servers the full scan cost about 40 us a dispatch).
        """
        best = fallback = None  # least loaded outside ``exclude``; least loaded inside it
        for client in self.clients:
            if not client.healthy or not accept(client):
                continue
            if client.address in exclude:
                if fallback is None or client.inflight < fallback.inflight:
                    fallback = client
            elif best is None or client.inflight < best.inflight:
                best = client
                if best.inflight == 0:
                    break
        return best or fallback

    async def pick(
        self, accept: Callable[[RolloutClient], bool], exclude: set[str], timeout_s: float, what: str
    ) -> RolloutClient:
        """Least-loaded healthy accepted server, preferring ones not in ``exclude``; waits up to ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            client = self.pick_now(accept, exclude)
            if client is not None:
                return client
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
        on_dispatch: Callable[[float], None] | None = None,
    ) -> tuple[list[SampleResult], RolloutClient]:
        """One Generate call, retried on another server when a server fails (each retry counted).

        ``on_dispatch(waited_s)`` is called once, as the first attempt is sent, with the seconds spent waiting for an
        accepted server (0 when one was there at once): the scheduler's dispatch latency histograms.
        """
        tried: set[str] = set()
        errors = []
        for attempt in range(1, max_attempts + 1):
            client = self.pick_now(accept, tried)
            waited_s = 0.0
            if client is None:
                waiting_since = time.monotonic()
                client = await self.pick(accept, tried, timeout_s, what)
                waited_s = time.monotonic() - waiting_since
            if on_dispatch is not None and attempt == 1:
                on_dispatch(waited_s)
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


HEALTH_EVERY_TICKS = 10  # refresh ticks between two health sweeps
FULL_READ_S = 1.0  # longest time between two reads of the fleet's version reports


class FleetWatcher:
    """Follows the trainer's version and the servers' reports in Redis (and hands those to discovery), and
    health-checks the servers."""

    def __init__(
        self,
        fleet: Fleet,
        on_version: Callable[[int], None],
        client: aioredis.Redis,
        keys: RedisKeys,
        interval_s: float = 0.2,
        on_version_offset: Callable[[int], None] | None = None,
        discovery=None,
    ):
        self.fleet = fleet
        self.on_version = on_version
        self.on_version_offset = on_version_offset  # (the trainer's version - steps) -> None
        self.client = client
        self.keys = keys
        self.board = AsyncVersionBoard(client, keys)
        self.interval_s = interval_s
        self.discovery = discovery  # coordinator.discovery.FleetDiscovery: the fleet follows the registrations
        self.health_watches = HealthWatches(fleet)
        self._reports_read: tuple[float, int] = (float("-inf"), -1)  # (monotonic time, trainer version) of last read

    async def refresh(self, reported: bool = False) -> None:
        """The trainer's version and offset every tick; the fleet's reports when they can have changed: after a
        server ``reported`` (a ``fleet:changes`` entry), after a new trainer version, while a server is behind it,
        and at least every ``FULL_READ_S`` (a restarted server is asked its version as its health returns,
        ``health_watch.py``; an added one by ``Fleet.add``)."""
        version, offset = await self.board.version_and_offset()
        if self.on_version_offset is not None:  # first: the shift must be in place before the new version counts
            self.on_version_offset(offset)
        self.on_version(version)
        read_at, read_version = self._reports_read
        behind = any(client.policy_version < version for client in self.fleet.clients)
        if not (reported or behind) and read_version == version and time.monotonic() - read_at < FULL_READ_S:
            return  # at 256 servers a read costs the coordinator about 1 ms (HGETALL parsed in Python)
        self._reports_read = (time.monotonic(), version)
        reports = await self.board.fleet_reports()
        if self.discovery is not None:
            await self.discovery.refresh(reports)
        by_address = {report.address: report for report in reports.values()}
        for client in self.fleet.clients:
            report = by_address.get(client.address)
            client.tokens_per_s = 0.0 if report is None else report.tokens_per_s
            if report is not None and report.policy_version != client.policy_version:
                client.policy_version = report.policy_version
        self.fleet.notify_changed()

    async def check_health(self, proven_within_s: float = 0.0) -> None:
        """Health-check the servers, except healthy ones that an open Watch stream reports SERVING or whose call
        succeeded within the last ``proven_within_s``.

        Either is as good a sign of life as the check, which costs the coordinator about 0.1 ms of CPU a server. A
        server that stops serving without its stream telling (none open) refuses the next call with UNAVAILABLE,
        which marks it unhealthy at once (``RolloutClient._failure``) and re-dispatches the call.
        """
        now = time.monotonic()
        for client in list(self.fleet.clients):
            vouched = self.health_watches.watching(client) or now - client.last_success_s < proven_within_s
            if client.healthy and vouched:
                continue
            was_healthy = client.healthy
            if not await client.check_health() and was_healthy:
                logger.warning("rollout server %s is unhealthy", client.address)
            elif client.healthy and not was_healthy:
                logger.info("rollout server %s is healthy again", client.address)
                self.fleet.notify_changed()

    async def run(self, stop: asyncio.Event) -> None:
        """Refresh as soon as a version is announced or a server reports (``AsyncVersionBoard.wait_for_change``),
        and at least every ``interval_s``; health-check the servers every ``HEALTH_EVERY_TICKS`` wake-ups.

        Waking on the reports matters on-policy (max_staleness 0): a step's groups may go only to a server on the
        new version, and a poll would leave the servers idle for up to ``interval_s`` after they loaded it."""
        last_ids: dict[str, str] | None = None
        reported = True
        next_health_check = 0.0
        try:
            while not stop.is_set():
                try:
                    last_ids = last_ids or await self.board.last_change_ids()  # before the refresh: none is missed
                    await self.refresh(reported)
                except UNREACHABLE as error:  # periodic: the next tick is the retry
                    logger.warning("fleet refresh skipped, Redis unreachable: %s", error)
                if time.monotonic() >= next_health_check:
                    self.health_watches.reconcile(stop)  # servers added or removed since
                    await self.check_health(proven_within_s=HEALTH_EVERY_TICKS * self.interval_s)
                    next_health_check = time.monotonic() + HEALTH_EVERY_TICKS * self.interval_s
                seen = last_ids
                last_ids = await self._wait_for_change(last_ids, stop)
                changes = self.keys.fleet_changes
                reported = seen is None or last_ids is None or last_ids[changes] != seen[changes]
        finally:
            await self.health_watches.close()

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
