"""The rollout server's registration in the run's fleet hash: a heartbeat while it serves, removed when it stops.

Every ``rollout.heartbeat_interval_s`` the server re-sends its ``VersionReport`` (address, policy version, the last
update's status, the engine's running and waiting requests, its capacity; ``time_s`` is the beat). The coordinator
routes to the servers whose beat is recent (coordinator/discovery.py), so a server that (re)starts on any address
is found without a static list. At shutdown the server removes its entry before it drains: the coordinator stops
sending it new calls while the ones in flight finish.
"""

from __future__ import annotations

import asyncio
import logging

from channels.retry import UNREACHABLE

logger = logging.getLogger(__name__)


async def beat(follower, interval_s: float, stop: asyncio.Event) -> None:
    """Re-send the follower's report every ``interval_s`` until ``stop``; Redis outages skip beats, not the server."""
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=interval_s)
            return
        except TimeoutError:
            pass
        try:
            await follower.report(follower.last_status, follower.last_message, changed=False)
        except UNREACHABLE as error:  # periodic: the next beat is the retry
            logger.warning("server %s: heartbeat skipped, Redis unreachable: %s", follower.engine.server_id, error)


def start_heartbeat(follower, interval_s: float, stop: asyncio.Event) -> list[asyncio.Task]:
    """The heartbeat task (none without a Redis to register in)."""
    if follower is None:
        return []
    return [asyncio.create_task(beat(follower, interval_s, stop), name="heartbeat")]


async def deregister(follower) -> None:
    """Leave the fleet hash (no report is written after this); a Redis outage leaves the entry to expire by age."""
    if follower is None:
        return
    follower.registered = False
    try:
        await follower.board.deregister(follower.engine.server_id)
    except UNREACHABLE as error:
        logger.warning(
            "server %s: could not leave the fleet hash (%s); discovery drops it once its beat is older than "
            "coordinator.server_timeout_s",
            follower.engine.server_id,
            error,
        )
