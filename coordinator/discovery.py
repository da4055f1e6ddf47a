"""FleetDiscovery: the coordinator's fleet follows the rollout servers' registrations in Redis.

Every rollout server re-sends its ``VersionReport`` to the run's ``fleet`` hash as a heartbeat
(rollout_service/heartbeat.py). On each refresh of the fleet view (``FleetWatcher``) discovery:

* adds a server whose beat is recent and whose address the fleet does not hold (once it answers a health check);
* drops (retires: its open calls finish) a server it has seen registered whose beat is older than
  ``coordinator.server_timeout_s`` or whose entry is gone (a server removes it when it stops; a restarted server
  overwrites it with its new address);
* leaves alone the servers that never registered (``--servers`` entries and ``fleetrl servers add`` of servers
  outside the registry), and never re-adds an address an operator removed until the operator adds it again.

Beat ages compare the server's clock with the coordinator's (``time_s`` is the server's ``time.time()``).
``connect_fleet`` is the coordinator's start: the listed servers, and with discovery the registered ones.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from channels.retry import UNREACHABLE
from channels.version_board import AsyncVersionBoard
from coordinator.fleet import Fleet
from coordinator.rollout_client import RolloutClient, RolloutFailed
from protos.records import VersionReport

logger = logging.getLogger(__name__)


class FleetDiscovery:
    """Adds beating servers to ``fleet`` and drops silent ones; remembers the operator's removals."""

    def __init__(self, fleet: Fleet, timeout_s: float, add_timeout_s: float = 2.0, retry_s: float = 2.0):
        self.fleet = fleet
        self.timeout_s = timeout_s
        self.add_timeout_s = add_timeout_s  # health check + ServerInfo of a server to add
        self.retry_s = retry_s  # a server that failed to join is tried again after this long
        self.operator_removed: dict[str, str] = {}  # address -> server id of the servers an operator removed
        self.registered: set[str] = set()  # addresses seen beating: the only ones discovery drops
        self.num_added = 0
        self.num_dropped = 0
        self._next_try: dict[str, float] = {}

    def live(self, reports: dict[str, VersionReport], now_s: float) -> dict[str, VersionReport]:
        """The reports whose beat is at most ``timeout_s`` old, by address."""
        return {r.address: r for r in reports.values() if r.address and now_s - r.time_s <= self.timeout_s}

    async def refresh(self, reports: dict[str, VersionReport], now_s: float | None = None) -> None:
        """Drop the registered servers that stopped beating, then add the beating ones the fleet lacks."""
        live = self.live(reports, time.time() if now_s is None else now_s)
        self.registered.update(live)
        for client in list(self.fleet.clients):
            if client.address in self.registered and client.address not in live:
                self.fleet.remove(client.address, keep_one=False)
                self.num_dropped += 1
                logger.warning(
                    "rollout server %s (%s) dropped: no registration within %.0fs (stopped, restarted elsewhere or "
                    "silent); its %d open calls finish or are re-dispatched",
                    client.address,
                    client.server_id,
                    self.timeout_s,
                    client.inflight,
                )
        removed_ids = set(self.operator_removed.values())
        for address, report in live.items():
            if address in self.operator_removed or report.server_id in removed_ids:
                continue  # the operator's decision stands, also for that server restarted elsewhere
            if self.fleet.find(address) is None:
                await self._add(address, report)

    async def _add(self, address: str, report: VersionReport) -> None:
        if self._next_try.get(address, 0.0) > time.monotonic():
            return
        try:
            await self.fleet.add(address, timeout_s=self.add_timeout_s)
        except ValueError:  # an operator added it meanwhile
            return
        except (RolloutFailed, grpc.aio.AioRpcError) as error:
            self._next_try[address] = time.monotonic() + self.retry_s
            logger.info("registered rollout server %s (%s) not joining yet: %s", address, report.server_id, error)
            return
        self._next_try.pop(address, None)
        self.num_added += 1
        logger.info("rollout server %s (%s, v%d) discovered", address, report.server_id, report.policy_version)

    def operator_removes(self, address: str, server_id: str) -> None:
        """``fleetrl servers remove``: discovery must not add the server back (at this or, restarted, another
        address) while it keeps beating."""
        self.operator_removed[address] = server_id

    def operator_added(self, address: str, server_id: str) -> None:
        """``fleetrl servers add`` succeeded: the operator's removals of this address and server end; discovery
        drops the server only once it has beaten and stopped."""
        self.operator_removed = {
            removed: sid for removed, sid in self.operator_removed.items() if removed != address and sid != server_id
        }
        self.registered.discard(address)


async def connect_fleet(servers: str, cfg, client, keys, timeout_s: float = 300.0):
    """The listed servers (``--servers``) and, with discovery, the registered ones; (fleet, discovery or None)."""
    fleet = Fleet([RolloutClient(address) for address in servers.split(",") if address])
    discovery = FleetDiscovery(fleet, cfg.server_timeout_s) if cfg.discovery else None
    if discovery is None and not fleet.clients:
        raise SystemExit("coordinator: no rollout servers: pass --servers, or leave coordinator.discovery on")
    await wait_for_servers(fleet, discovery, AsyncVersionBoard(client, keys), timeout_s)
    return fleet, discovery


async def wait_for_servers(fleet, discovery, board, timeout_s: float) -> None:
    """Until every listed server is healthy and, with discovery, the fleet holds at least one server."""
    deadline = time.monotonic() + timeout_s
    for client in fleet.clients:
        while not await client.check_health():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rollout server {client.address} not healthy after {timeout_s}s")
            await asyncio.sleep(0.5)
        await client.info()
    while discovery is not None and not fleet.clients:
        try:
            await discovery.refresh(await board.fleet_reports())
        except UNREACHABLE as error:  # a poll: its next pass is the retry (channels/retry.py)
            logger.warning("waiting for rollout servers to register: Redis unreachable: %s", error)
        if not fleet.clients and time.monotonic() > deadline:
            raise TimeoutError(
                f"no rollout server registered in Redis ({board.keys.fleet}) within {timeout_s}s: start servers "
                "with this run's redis_url and run_id, or pass --servers"
            )
        await asyncio.sleep(0.5)


async def served_max_model_len(fleet, max_tokens: int) -> int:
    """The context length the fleet serves, for a coordinator whose machine cannot read the checkpoint (its
    ``rollout.max_model_len`` then stays unresolved: protos/config/checkpoint.py); every server serves the run's one
    model, so a healthy one answers. Refused, naming both fields, when a response of ``max_tokens`` cannot fit."""
    server, info = await fleet.served_info()
    served = info.max_model_len
    if max_tokens >= served:
        raise ValueError(
            f"coordinator.sampling.max_tokens must be below rollout.max_model_len ({max_tokens} >= {served}, the "
            f"context length server {server.address} serves)"
        )
    return served
