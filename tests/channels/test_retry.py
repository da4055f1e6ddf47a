"""The one retry policy: idempotent calls repeated while Redis is unreachable, with backoff, up to a deadline."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from channels import retry

pytestmark = pytest.mark.unit


class Flaky:
    """Fails ``failures`` times with ``error``, then returns ``result``; counts calls."""

    def __init__(self, failures: int, error: BaseException, result="ok"):
        self.failures, self.error, self.result, self.calls = failures, error, result, 0

    def __call__(self):
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return self.result


def test_a_call_is_repeated_while_redis_is_unreachable_and_its_result_returned(monkeypatch):
    monkeypatch.setattr(retry, "FIRST_PAUSE_S", 0.001)
    call = Flaky(3, RedisConnectionError("refused"))
    assert retry.retry_sync(call, "test", timeout_s=5) == "ok" and call.calls == 4


def test_after_its_deadline_the_last_error_propagates(monkeypatch):
    monkeypatch.setattr(retry, "FIRST_PAUSE_S", 0.01)
    call = Flaky(10**6, ConnectionResetError("reset"))
    started = time.monotonic()
    with pytest.raises(ConnectionResetError):
        retry.retry_sync(call, "test", timeout_s=0.2)
    assert 0.05 < time.monotonic() - started < 1.0 and call.calls > 2


def test_an_error_of_the_command_itself_is_not_retried():
    call = Flaky(1, ResponseError("WRONGTYPE"))
    with pytest.raises(ResponseError):
        retry.retry_sync(call, "test", timeout_s=5)
    assert call.calls == 1


def test_the_pauses_back_off_up_to_the_cap():
    pauses = retry._pauses()
    seen = [next(pauses) for _ in range(8)]
    assert seen[0] == retry.FIRST_PAUSE_S and seen == sorted(seen) and seen[-1] == retry.MAX_PAUSE_S


def test_the_async_form_retries_the_same_way(monkeypatch):
    monkeypatch.setattr(retry, "FIRST_PAUSE_S", 0.001)
    call = Flaky(2, RedisConnectionError("refused"))

    async def once():
        return call()

    assert asyncio.run(retry.retry_async(once, "test", timeout_s=5)) == "ok" and call.calls == 3
