"""A stable address for the OpenAI door: a port picked at start is kept in the run's Redis and taken again by a
restarted coordinator of the same run, so every agent's base URL outlives the restart (docs/agents.md).

Only a picked port (``agent.openai_port: 0``) is kept; a configured one is the operator's to keep. When the kept
port is taken by another process, the door starts on a new free port, keeps that one, and says so in a warning.
"""

from __future__ import annotations

import errno
import logging

from coordinator.openai_door import MAX_BODY_BYTES, start_openai_door
from protos.redis_keys import RedisKeys, as_text

__all__ = ["start_openai_door_of_run"]

logger = logging.getLogger(__name__)


async def start_openai_door_of_run(
    book, tokenizer, authorize, host: str, port: int, redis, keys: RedisKeys, max_body_bytes: int = MAX_BODY_BYTES
):
    """``start_openai_door`` on ``port``, or for ``port`` 0 on the port an earlier coordinator of the run picked
    (kept under ``keys.openai_door_port``); returns the runner and the bound port."""
    if port != 0:
        return await start_openai_door(book, tokenizer, authorize, host, port, max_body_bytes)
    kept = await redis.get(keys.openai_door_port)
    kept_port = int(as_text(kept)) if kept is not None else 0
    if kept_port:
        try:
            return await start_openai_door(book, tokenizer, authorize, host, kept_port, max_body_bytes)
        except OSError as error:
            if error.errno != errno.EADDRINUSE:
                raise
            logger.warning(
                "openai door: the run's port %d on %s is taken by another process; starting on a new free port, "
                "agents must change their base URL",
                kept_port,
                host,
            )
    runner, bound_port = await start_openai_door(book, tokenizer, authorize, host, 0, max_body_bytes)
    await redis.set(keys.openai_door_port, bound_port)
    logger.info("openai door: port %d kept for restarts of run %s", bound_port, keys.run_id)
    return runner, bound_port
