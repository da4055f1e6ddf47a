"""Shared fixtures: one embedded valkey server per test session, flushed before each test that uses it."""

from __future__ import annotations

import pytest
import redis

from coordinator.redis_server import EmbeddedRedis


@pytest.fixture(scope="session")
def redis_server():
    """A real valkey-server process (EmbeddedRedis) shared by the whole session."""
    server = EmbeddedRedis().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    """URL of the session server with an empty keyspace (FLUSHALL before the test)."""
    client = redis.Redis.from_url(redis_server.url)
    try:
        client.flushall()
    finally:
        client.close()
    return redis_server.url


TIERS = ("unit", "integration", "e2e")


def pytest_collection_modifyitems(config, items):
    """Every test sits in exactly one tier (its module's ``pytestmark``); one without is a collection error."""
    for item in items:
        tiers = {mark.name for mark in item.iter_markers() if mark.name in TIERS}
        if len(tiers) != 1:
            raise pytest.UsageError(
                f"{item.nodeid} must be marked with one of {TIERS} (module pytestmark), has {tiers}"
            )
