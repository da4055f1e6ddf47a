"""A run's kept port: a port picked at start (configured 0) is kept in the run's Redis and bound again by a
restarted coordinator of the same run, so every client's address outlives the restart (docs/agents.md).

Two listeners keep theirs: the agent gRPC API (``agent.port: 0``, ``keys.agent_api_port``) and the OpenAI door
(``agent.openai_port: 0``, ``keys.openai_door_port``). Only a picked port is kept; a configured one is the
operator's to keep. When the kept port is taken by another process, the listener starts on a new free port, keeps
that one, and says so in a warning: its clients must then change their address.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from coordinator.agents.api import start_agent_server
from coordinator.agents.door import MAX_BODY_BYTES, start_openai_door
from protos.redis_keys import RedisKeys, as_text

__all__ = ["PortTaken", "listen_on_kept_port", "start_agent_server_of_run", "start_openai_door_of_run"]

logger = logging.getLogger(__name__)

Listener = TypeVar("Listener")


class PortTaken(Exception):
    """A listener could not bind its kept port: another process holds it."""


async def listen_on_kept_port(
    listen: Callable[[int], Awaitable[tuple[Listener, int]]], port: int, redis, key: str, what: str, host: str
) -> tuple[Listener, int]:
    """``listen(port)``, or for ``port`` 0 ``listen`` on the port an earlier coordinator of the run picked (kept
    under ``key``), else on a new free one that is kept from then on; returns the listener and the bound port.

    ``listen`` raises ``PortTaken`` when the port it was given is held by another process; ``what`` names the
    listener in the log lines.
    """
    if port != 0:
        return await listen(port)
    kept = await redis.get(key)
    kept_port = int(as_text(kept)) if kept is not None else 0
    if kept_port:
        try:
            return await listen(kept_port)
        except PortTaken:
            logger.warning(
                "%s: the run's port %d on %s is taken by another process; starting on a new free port, its clients "
                "must change their address",
                what,
                kept_port,
                host,
            )
    listener, bound_port = await listen(0)
    await redis.set(key, bound_port)
    logger.info("%s: port %d kept for restarts of the run (%s)", what, bound_port, key)
    return listener, bound_port


async def start_openai_door_of_run(
    book, tokenizer, authorize, host: str, port: int, redis, keys: RedisKeys, max_body_bytes: int = MAX_BODY_BYTES
):
    """``start_openai_door`` on ``port``, or for ``port`` 0 on the run's kept port (``keys.openai_door_port``);
    returns the runner and the bound port."""

    async def listen(at: int):
        try:
            return await start_openai_door(book, tokenizer, authorize, host, at, max_body_bytes)
        except OSError as error:
            if error.errno != errno.EADDRINUSE:
                raise
            raise PortTaken(f"openai door: {host}:{at} is taken by another process") from error

    return await listen_on_kept_port(listen, port, redis, keys.openai_door_port, "openai door", host)


async def start_agent_server_of_run(book, auth, config, redis, keys: RedisKeys):
    """``start_agent_server`` on ``config.port``, or for ``config.port`` 0 on the run's kept port
    (``keys.agent_api_port``); returns the gRPC server and the bound port."""

    async def listen(at: int):
        try:
            return await start_agent_server(book, auth, config, at)
        except RuntimeError as error:  # grpc says only that it could not bind; it logs the cause (in use)
            raise PortTaken(f"agent API: cannot bind {config.host}:{at} (taken by another process?)") from error

    return await listen_on_kept_port(listen, config.port, redis, keys.agent_api_port, "agent API", config.host)
