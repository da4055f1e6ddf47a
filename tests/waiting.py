"""Waiting on conditions in tests: poll ``condition()`` until it returns something truthy, and fail after a timeout
with a message naming what was waited for and the last value seen. Tests wait on these instead of fixed sleeps."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any


class WaitTimeout(AssertionError):
    """A condition did not hold within its timeout (an AssertionError, so pytest reports it as a failed check)."""

    def __init__(self, what: str, timeout_s: float, last: object):
        shown = repr(last)
        if len(shown) > 400:
            shown = shown[:400] + "..."
        super().__init__(f"not within {timeout_s}s: {what} (last seen: {shown})")
        self.what = what
        self.last = last


def wait_until(condition: Callable[[], Any], what: str, timeout_s: float, poll_s: float = 0.05) -> Any:
    """Polls ``condition()`` every ``poll_s`` until it returns a truthy value, and returns that value.

    Raises:
        WaitTimeout: ``condition()`` was still falsy after ``timeout_s``; names ``what`` and the last value.
    """
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() >= deadline:
            raise WaitTimeout(what, timeout_s, value)
        time.sleep(poll_s)
    return value


async def wait_until_async(
    condition: Callable[[], Any | Awaitable[Any]], what: str, timeout_s: float, poll_s: float = 0.05
) -> Any:
    """The event-loop twin of :func:`wait_until`: ``condition`` may be a plain function or return an awaitable (an
    ``async def``), and the loop runs other tasks between polls."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise WaitTimeout(what, timeout_s, value)
        await asyncio.sleep(poll_s)
