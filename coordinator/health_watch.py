"""HealthWatches: each rollout server's gRPC health as the server pushes it (``grpc.health.v1.Health/Watch``).

One long-lived Watch stream per routable server: the server sends its status only when it changes, so a healthy
fleet costs the coordinator nothing between changes (a health-check RPC per server every 2 s took about 15% of the
coordinator's loop at 256 servers, benchmarks/fleet_scale.py), and a server that stops serving (draining) or goes
away is seen at once rather than at the next sweep. A broken stream marks its server unhealthy and is opened again
every ``retry_s``. A server that turns SERVING after being unhealthy is asked its policy version (ServerInfo) before
it is routed to again: a restarted server serves its initial weights until it has caught up, which the fleet
reports in Redis would only tell at the next refresh. ``FleetWatcher``'s sweep still checks the servers not watched and the unhealthy ones: a failed
call marks a server unhealthy without its stream noticing, and the sweep is what finds it serving again.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health_pb2

from coordinator.rollout_client import RolloutClient

logger = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING


class HealthWatches:
    """The Watch streams of a fleet's servers; ``reconcile`` keeps one per routable server, ``close`` ends them."""

    def __init__(self, fleet, retry_s: float = 1.0):
        self.fleet = fleet  # coordinator.fleet.Fleet
        self.retry_s = retry_s
        self._tasks: dict[str, tuple[RolloutClient, asyncio.Task]] = {}
        self._serving: set[str] = set()  # addresses whose open stream last said SERVING

    def watching(self, client: RolloutClient) -> bool:
        """Whether an open Watch stream last reported ``client``'s server SERVING."""
        return client.address in self._serving

    def reconcile(self, stop: asyncio.Event) -> None:
        """Open a stream for every routable server without one; end those of servers no longer routed to."""
        routable = {client.address: client for client in self.fleet.clients}
        for address, (client, task) in list(self._tasks.items()):
            if routable.get(address) is not client:
                task.cancel()
                del self._tasks[address]
                self._serving.discard(address)
        for address, client in routable.items():
            if address not in self._tasks:
                task = asyncio.create_task(self._watch(client, stop), name=f"health-watch-{address}")
                self._tasks[address] = (client, task)

    async def _watch(self, client: RolloutClient, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                async for reply in client.health.Watch(health_pb2.HealthCheckRequest(service="")):
                    serving = reply.status == SERVING
                    if serving and not client.healthy:
                        await client.info()  # its version now, before any group is routed to it
                    self._update(client, serving, "health watch")
                why = "its health stream ended"
            except grpc.aio.AioRpcError as error:
                why = f"health stream: {error.code().name}"
            if stop.is_set():  # the coordinator is closing its channels
                return
            self._update(client, False, why)
            try:  # the server went away: try again in a moment (or stop)
                await asyncio.wait_for(stop.wait(), timeout=self.retry_s)
            except TimeoutError:
                pass

    def _update(self, client: RolloutClient, serving: bool, why: str) -> None:
        if serving:
            self._serving.add(client.address)
        else:
            self._serving.discard(client.address)
        if serving and not client.healthy:
            logger.info("rollout server %s is healthy again (%s)", client.address, why)
            client.healthy = True
            self.fleet.notify_changed()
        elif not serving and client.healthy:
            logger.warning("rollout server %s is unhealthy (%s)", client.address, why)
            client.healthy = False

    async def close(self) -> None:
        tasks = [task for _, task in self._tasks.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self._serving.clear()
