"""Shared fixtures: one embedded valkey server per test session, flushed before each test that uses it; the
Megatron CPU shims undone after every test module that installed them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import redis

from launcher.redis_server import EmbeddedRedis


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


# CI keeps a copy of shared/ beside the clone; a clone elsewhere skips the tests that read its data.
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture
def shared_data() -> Path:
    """``../shared/data`` beside the repository (AIME 2024 / 2025, the DAPO-Math slice); the test is skipped where it
    is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"test data folder {SHARED_DATA} is absent (expected shared/ beside the repo)")
    return SHARED_DATA


@pytest.fixture(scope="module", autouse=True)
def megatron_cpu_shims_undone():
    """A module that builds a MegatronBackend on a CPU torch patches ``torch.cuda`` (trainer_service.megatron.cpu_shims);
    the patches are reverted once its fixtures are torn down, so no other module's tests run with them."""
    yield
    shims = sys.modules.get("trainer_service.megatron.cpu_shims")  # never imported: nothing to undo
    if shims is not None:
        shims.undo()


TIERS = ("unit", "integration", "e2e")


def pytest_collection_modifyitems(config, items):
    """Every test sits in exactly one tier (its module's ``pytestmark``); one without is a collection error."""
    for item in items:
        tiers = {mark.name for mark in item.iter_markers() if mark.name in TIERS}
        if len(tiers) != 1:
            raise pytest.UsageError(
                f"{item.nodeid} must be marked with one of {TIERS} (module pytestmark), has {tiers}"
            )
