"""Fixtures of the channel tests: a sync client of the session Redis, and private servers a test may kill."""

from __future__ import annotations

import pytest
import redis

from launcher.redis_server import EmbeddedRedis


@pytest.fixture
def client(redis_url):
    """A sync client of the (flushed) session server."""
    c = redis.Redis.from_url(redis_url)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def private_server(tmp_path):
    """``start(port=0)``: a valkey server of this test alone (append-only file on), stopped at the end."""
    servers: list[EmbeddedRedis] = []

    def start(port: int = 0) -> EmbeddedRedis:
        server = EmbeddedRedis(port=port, data_dir=str(tmp_path / "valkey"), appendonly=True).start()
        servers.append(server)
        return server

    (tmp_path / "valkey").mkdir()
    try:
        yield start
    finally:
        for server in servers:
            server.stop()
