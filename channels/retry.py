"""The one retry policy for Redis outages, used by every role and the weight bus.

Which calls are retried: only idempotent ones, whose repetition after a lost reply changes nothing: reads, SETs of
the same value, XACK, DEL, a transaction that sets the same values, a Lua step that checks whether it already ran
(the coordinator's push checks its own prompt cursor). A call that is not idempotent must make itself so before it
comes here (a dedupe key), because a connection broken after Redis ran the command looks the same as one broken
before it.

How: while Redis is unreachable (connection refused or reset, a socket timeout), the call is repeated with
exponential backoff (``FIRST_PAUSE_S`` doubling up to ``MAX_PAUSE_S``) until ``timeout_s`` has passed; then the last
error propagates and the caller decides (the trainer exits and restarts from its checkpoint, a report is dropped
with an error log). Every retry is logged with what it waits for.

Periodic calls (metrics reports, fleet refreshes, heartbeats) are not retried here: their next period is the retry,
and they log and skip meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

logger = logging.getLogger(__name__)

T = TypeVar("T")
# redis-py's own errors, and socket errors (refused, reset) a connection can surface before redis-py wraps them
UNREACHABLE: tuple[type[BaseException], ...] = (RedisConnectionError, RedisTimeoutError, OSError)
FIRST_PAUSE_S = 0.1
MAX_PAUSE_S = 2.0


def _pauses():
    pause = FIRST_PAUSE_S
    while True:
        yield pause
        pause = min(MAX_PAUSE_S, pause * 2)


def retry_sync(call: Callable[[], T], what: str, timeout_s: float) -> T:
    """``call()``, repeated while Redis is unreachable for up to ``timeout_s``; then the last error propagates."""
    deadline = time.monotonic() + timeout_s
    for pause in _pauses():
        try:
            return call()
        except UNREACHABLE as error:
            if time.monotonic() + pause > deadline:
                raise
            logger.warning("%s: Redis unreachable, retrying in %.1fs: %s", what, pause, error)
            time.sleep(pause)
    raise AssertionError("unreachable")  # _pauses() never ends


async def retry_async(call: Callable[[], Awaitable[T]], what: str, timeout_s: float) -> T:
    """``await call()``, repeated while Redis is unreachable for up to ``timeout_s``; then the last error propagates."""
    deadline = time.monotonic() + timeout_s
    for pause in _pauses():
        try:
            return await call()
        except UNREACHABLE as error:
            if time.monotonic() + pause > deadline:
                raise
            logger.warning("%s: Redis unreachable, retrying in %.1fs: %s", what, pause, error)
            await asyncio.sleep(pause)
    raise AssertionError("unreachable")
