"""A run's kept port (coordinator/kept_port.py) for the agent gRPC API: a picked port is kept in the run's Redis and
bound again by a restarted coordinator of the run, a taken one moves with a warning, a configured one is not kept.

A real grpc.aio agent server and real Redis. No session book is needed: which port the server binds does not touch
sessions, and a call without a token is refused by the token check before any session is looked at, which shows
the AgentService itself answers on the port. The door's keeping is tested through the real door in
agents/test_openai_agent_surface.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import socket

import grpc
import pytest
import redis.asyncio as aioredis
import yaml

from coordinator.agents.api import agent_authenticator, start_agent_server
from coordinator.kept_port import start_agent_server_of_run
from protos import agent_pb2 as pb
from protos import agent_pb2_grpc as pb_grpc
from protos.config.agent import AgentConfig
from protos.redis_keys import RedisKeys

pytestmark = pytest.mark.integration

KEYS = RedisKeys("kept-ports")
CALL_TIMEOUT_S = 10.0


@pytest.fixture
def agent_config(tmp_path) -> AgentConfig:
    grant = {
        "name": "team-a",
        "token_sha256": hashlib.sha256(b"secret-a").hexdigest(),
        "scopes": ["generate"],
        "rate_per_s": 100,
    }
    path = tmp_path / "tokens.yaml"
    path.write_text(yaml.safe_dump({"tokens": [grant]}))
    return AgentConfig(enabled=True, tokens_file=str(path), port=0)


async def refused_without_token(port: int) -> grpc.StatusCode:
    """The status an OpenSession without a token gets from the agent server on ``port``."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.AgentServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.OpenSession(pb.OpenSessionRequest(group_key="k", group_size=1), timeout=CALL_TIMEOUT_S)
    return refused.value.code()


def test_a_picked_agent_api_port_is_kept_for_the_run_and_bound_again_after_a_restart(redis_url, agent_config):
    async def scenario():
        redis = aioredis.Redis.from_url(redis_url)
        auth = agent_authenticator(agent_config)
        start = (None, auth, agent_config, redis, KEYS)
        try:
            server, port = await start_agent_server_of_run(*start)
            await server.stop(grace=0)  # the coordinator stops
            server, again = await start_agent_server_of_run(*start)  # and its successor starts
            try:
                assert again == port and int(await redis.get(KEYS.agent_api_port)) == port
                assert await refused_without_token(port) == grpc.StatusCode.UNAUTHENTICATED
                other_run = RedisKeys("kept-ports-other")
                other, other_port = await start_agent_server_of_run(None, auth, agent_config, redis, other_run)
                await other.stop(grace=0)
                assert other_port != port and int(await redis.get(other_run.agent_api_port)) == other_port
            finally:
                await server.stop(grace=0)
        finally:
            await redis.aclose()

    asyncio.run(scenario())


def test_a_taken_agent_api_port_moves_to_a_new_kept_one_with_a_warning(redis_url, agent_config, caplog):
    async def scenario():
        redis = aioredis.Redis.from_url(redis_url)
        auth = agent_authenticator(agent_config)
        start = (None, auth, agent_config, redis, KEYS)
        try:
            server, port = await start_agent_server_of_run(*start)
            await server.stop(grace=0)
            # Another run's coordinator took the port meanwhile: it must not share it (no SO_REUSEPORT).
            squatter, _ = await start_agent_server(None, auth, agent_config, port)
            try:
                with caplog.at_level(logging.WARNING, logger="coordinator.kept_port"):
                    server, moved = await start_agent_server_of_run(*start)
                await server.stop(grace=0)
            finally:
                await squatter.stop(grace=0)
            assert moved != port and int(await redis.get(KEYS.agent_api_port)) == moved
            assert f"agent API: the run's port {port} on 127.0.0.1 is taken" in caplog.text

            with socket.socket() as plain:  # a process that is no gRPC server at all
                plain.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the stopped server's TIME_WAIT
                plain.bind(("127.0.0.1", moved))
                plain.listen()
                server, moved_again = await start_agent_server_of_run(*start)
                await server.stop(grace=0)
            assert moved_again != moved and int(await redis.get(KEYS.agent_api_port)) == moved_again
        finally:
            await redis.aclose()

    asyncio.run(scenario())


def test_a_configured_agent_api_port_is_used_as_it_is_and_never_kept(redis_url, agent_config):
    async def scenario():
        redis = aioredis.Redis.from_url(redis_url)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            configured = probe.getsockname()[1]
        config = agent_config.model_copy(update={"port": configured})
        try:
            server, bound = await start_agent_server_of_run(None, agent_authenticator(config), config, redis, KEYS)
            try:
                assert bound == configured and await redis.get(KEYS.agent_api_port) is None
                assert await refused_without_token(bound) == grpc.StatusCode.UNAUTHENTICATED
            finally:
                await server.stop(grace=0)
        finally:
            await redis.aclose()

    asyncio.run(scenario())
