"""coordinator.auth on real gRPC servers on 127.0.0.1: ``Authenticator.check`` in handlers, ``ScopeInterceptor``,
TLS with a self-signed certificate made here, and the admin API and CLI with a token file."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
import redis.asyncio as aioredis

from channels.trajectory_stream import TrajectoryStreamWriter
from coordinator.admin import AdminCore, start_admin_server
from coordinator.auth import (
    Authenticator,
    Refused,
    Scope,
    ScopeInterceptor,
    TokenBook,
    add_port,
)
from coordinator.control import ControlChannel
from coordinator.fleet import Fleet
from coordinator.metrics import MetricsReporter
from coordinator.scheduler import Scheduler
from coordinator.tasks import EchoTask
from launcher.auth_client import call_metadata, channel_credentials
from launcher.cli import main as fleetrl
from protos.config import load_run_config
from protos.config.agent import AgentConfig
from protos.redis_keys import RedisKeys

pytestmark = pytest.mark.integration

SERVICE = "fleetrl.test.Probe"
TOKENS = """tokens:
  - {name: team-a, token: tok-generate-submit, scopes: [generate, submit], rate_per_s: 1000, burst: 1000}
  - {name: ops, token: tok-admin, scopes: [admin], rate_per_s: 1000, burst: 1000}
  - {name: slow, token: tok-slow, scopes: [generate], rate_per_s: 2, burst: 2}
"""


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def tokens_file(tmp_path) -> str:
    path = tmp_path / "tokens.yaml"
    path.write_text(TOKENS)
    return str(path)


class Probe:
    """A service of three methods; ``bodies`` counts the calls whose body ran (past the auth check, if any)."""

    def __init__(self, authenticator: Authenticator | None):
        self.authenticator, self.bodies = authenticator, 0

    async def _guard(self, context, scope: Scope) -> str:
        if self.authenticator is None:  # guarded by an interceptor instead
            return ""
        return (await self.authenticator.check(context, scope)).name

    async def generate(self, request: bytes, context) -> bytes:
        name = await self._guard(context, Scope.GENERATE)
        self.bodies += 1
        return name.encode()

    async def submit(self, request: bytes, context) -> bytes:
        name = await self._guard(context, Scope.SUBMIT)
        self.bodies += 1
        return name.encode()

    async def stream(self, request: bytes, context):
        self.bodies += 1
        for chunk in (b"a", b"b"):
            yield chunk

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Generate": grpc.unary_unary_rpc_method_handler(self.generate),
                "Submit": grpc.unary_unary_rpc_method_handler(self.submit),
                "Stream": grpc.unary_stream_rpc_method_handler(self.stream),
            },
        )


async def serve(probe: Probe, interceptors=(), agent: AgentConfig | None = None) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(interceptors=list(interceptors))
    server.add_generic_rpc_handlers((probe.handler(),))
    port = add_port(server, "127.0.0.1:0", agent or AgentConfig())
    assert port > 0
    await server.start()
    return server, f"127.0.0.1:{port}"


async def call(channel: grpc.aio.Channel, method: str, token: str | None, **kwargs) -> bytes:
    metadata = call_metadata(token) if token is not None else ()
    return await channel.unary_unary(f"/{SERVICE}/{method}")(b"", metadata=metadata, timeout=10, **kwargs)


async def refused(coro) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await coro
    return error.value


def test_check_returns_the_grant_of_the_right_token_and_scope(tokens_file):
    async def body() -> None:
        probe = Probe(Authenticator(TokenBook.load(tokens_file)))
        server, address = await serve(probe)
        async with grpc.aio.insecure_channel(address) as channel:
            assert await call(channel, "Generate", "tok-generate-submit") == b"team-a"
            assert await call(channel, "Submit", "tok-generate-submit") == b"team-a"
        await server.stop(0)
        assert probe.bodies == 2

    asyncio.run(body())


def test_check_refuses_missing_wrong_and_underscoped_tokens_and_the_body_never_runs(tokens_file):
    async def body() -> None:
        probe = Probe(Authenticator(TokenBook.load(tokens_file)))
        server, address = await serve(probe)
        async with grpc.aio.insecure_channel(address) as channel:
            error = await refused(call(channel, "Generate", None))
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED and "no authorization metadata" in error.details()
            error = await refused(call(channel, "Generate", "tok-wrong-secret"))
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED and error.details() == "unknown bearer token"
            error = await refused(channel.unary_unary(f"/{SERVICE}/Generate")(b"", metadata=(("authorization", "x"),)))
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED and "malformed" in error.details()
            error = await refused(call(channel, "Submit", "tok-slow"))
            assert error.code() == grpc.StatusCode.PERMISSION_DENIED
            assert error.details() == "token 'slow' lacks scope 'submit'"
        await server.stop(0)
        assert probe.bodies == 0

    asyncio.run(body())


def test_check_refuses_past_the_rate_limit_with_retry_after_ms(tokens_file):
    async def body() -> None:
        clock = Clock()
        probe = Probe(Authenticator(TokenBook.load(tokens_file), clock=clock))
        server, address = await serve(probe)
        async with grpc.aio.insecure_channel(address) as channel:
            for _ in range(2):  # the burst
                assert await call(channel, "Generate", "tok-slow") == b"slow"
            error = await refused(call(channel, "Generate", "tok-slow"))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "rate limit of token 'slow' (2/s, burst 2) exceeded; retry after 500 ms" == error.details()
            assert dict(error.trailing_metadata())["retry-after-ms"] == "500"
            assert await call(channel, "Generate", "tok-generate-submit") == b"team-a"  # one bucket per grant
            clock.now += 0.5
            assert await call(channel, "Generate", "tok-slow") == b"slow"
        await server.stop(0)
        assert probe.bodies == 4

    asyncio.run(body())


def test_the_interceptor_guards_every_method_and_runs_no_handler_on_refusal(tokens_file):
    async def body() -> None:
        probe = Probe(None)
        interceptor = ScopeInterceptor(Authenticator(TokenBook.load(tokens_file), clock=Clock()), Scope.ADMIN)
        server, address = await serve(probe, [interceptor])
        async with grpc.aio.insecure_channel(address) as channel:
            stream = channel.unary_stream(f"/{SERVICE}/Stream")
            for token, code in [
                (None, grpc.StatusCode.UNAUTHENTICATED),
                ("tok-wrong-secret", grpc.StatusCode.UNAUTHENTICATED),
                ("tok-generate-submit", grpc.StatusCode.PERMISSION_DENIED),
            ]:
                metadata = call_metadata(token) if token else ()
                error = await refused(call(channel, "Generate", token))
                assert error.code() == code
                error = await refused(_drain(stream(b"", metadata=metadata, timeout=10)))
                assert error.code() == code
                assert "tok-" not in error.details()
            assert error.details() == "token 'team-a' lacks scope 'admin'"
            assert probe.bodies == 0
            assert await call(channel, "Generate", "tok-admin") == b""
            assert await _drain(stream(b"", metadata=call_metadata("tok-admin"), timeout=10)) == [b"a", b"b"]
        await server.stop(0)
        assert probe.bodies == 2

    asyncio.run(body())


def test_the_interceptor_applies_the_rate_limit_with_retry_after_ms(tmp_path):
    path = tmp_path / "tokens.yaml"
    path.write_text("tokens:\n  - {name: ops, token: tok-admin, scopes: [admin], rate_per_s: 1, burst: 1}\n")

    async def body() -> None:
        probe = Probe(None)
        server, address = await serve(
            probe, [ScopeInterceptor(Authenticator(TokenBook.load(path), clock=Clock()), Scope.ADMIN)]
        )
        async with grpc.aio.insecure_channel(address) as channel:
            await call(channel, "Generate", "tok-admin")
            error = await refused(call(channel, "Generate", "tok-admin"))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert dict(error.trailing_metadata())["retry-after-ms"] == "1000"
        await server.stop(0)
        assert probe.bodies == 1

    asyncio.run(body())


async def _drain(stream) -> list[bytes]:
    return [chunk async for chunk in stream]


def test_a_tls_server_answers_a_tls_client_and_refuses_a_plaintext_one(tokens_file, tls_pair):
    cert_file, key_file = tls_pair

    async def body() -> None:
        probe = Probe(Authenticator(TokenBook.load(tokens_file)))
        server, address = await serve(probe, agent=AgentConfig(tls_cert_file=cert_file, tls_key_file=key_file))
        async with grpc.aio.secure_channel(address, channel_credentials(cert_file)) as channel:
            assert await call(channel, "Generate", "tok-generate-submit") == b"team-a"
        async with grpc.aio.insecure_channel(address) as channel:
            error = await refused(call(channel, "Generate", "tok-generate-submit"))
            assert error.code() == grpc.StatusCode.UNAVAILABLE
        await server.stop(0)
        assert probe.bodies == 1

    asyncio.run(body())


@pytest.fixture
def guarded_admin(redis_url, tokens_file, tls_pair):
    """The admin server over a coordinator core, with a token file and TLS, on a loop in a background thread."""
    cert_file, key_file = tls_pair
    loop, started, ready = asyncio.new_event_loop(), {}, threading.Event()

    async def start() -> None:
        overrides = [f"agent.tokens_file={tokens_file}", f"agent.tls_cert_file={cert_file}"]
        run = load_run_config(overrides=["run_id=admin-auth", *overrides, f"agent.tls_key_file={key_file}"])
        client, keys = aioredis.Redis.from_url(redis_url), RedisKeys(run.run_id)
        scheduler = Scheduler(run, Fleet([]), TrajectoryStreamWriter(client, keys), EchoTask(), 20)
        reporter = MetricsReporter(scheduler, None, scheduler.queue, client, keys)
        core = AdminCore(run, scheduler, reporter, ControlChannel(client, keys), None)
        server, port = await start_admin_server(core, "127.0.0.1", 0)
        started.update(server=server, address=f"127.0.0.1:{port}", ca=cert_file)
        ready.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()), daemon=True)
    thread.start()
    assert ready.wait(10), "admin server did not start"
    yield started
    asyncio.run_coroutine_threadsafe(started["server"].stop(0), loop).result(5)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        fleetrl(list(argv))
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def test_the_admin_cli_passes_its_token_over_tls_and_a_refused_token_is_one_line_and_exit_2(
    guarded_admin, capsys, monkeypatch
):
    where = ["--admin", guarded_admin["address"], "--tls-ca", guarded_admin["ca"]]
    code, out, _ = cli(capsys, "status", *where, "--token", "tok-admin")
    assert code == 0 and "run admin-auth | running | task echo" in out
    monkeypatch.setenv("FLEETRL_TOKEN", "tok-admin")  # the default of --token, read when the parser is built
    code, out, _ = cli(capsys, "pause", *where)
    assert code == 0 and out.startswith("coordinator paused")
    for token, message in [
        ("tok-wrong-secret", "unknown bearer token (UNAUTHENTICATED); pass --token TOKEN or set FLEETRL_TOKEN"),
        ("", "no authorization metadata"),
        ("tok-generate-submit", "token 'team-a' lacks scope 'admin' (PERMISSION_DENIED); the admin verbs need"),
    ]:
        code, out, err = cli(capsys, "resume", *where, "--token", token)
        assert code == 2 and out == "" and err.count("\n") == 1, err
        assert err.startswith("fleetrl resume: ") and message in err and "tok-" not in err, err
    code, _, err = cli(capsys, "status", "--admin", guarded_admin["address"], "--timeout-s", "1")  # plaintext
    assert code == 3 and "(if it speaks TLS, pass --tls-ca FILE)" in err, err
    code, _, err = cli(capsys, "status", "--admin", guarded_admin["address"], "--tls-ca", "/nonexistent/ca.pem")
    assert (
        code == 2
        and err == "fleetrl status: --tls-ca /nonexistent/ca.pem: cannot read it (No such file or directory)\n"
    )


def test_one_rate_limit_per_token_across_the_admin_api_the_agent_api_and_the_openai_door(redis_url, tmp_path):
    """The coordinator's APIs share the process's one Authenticator: calls on any of them spend the same budget."""
    from coordinator.agents.api import agent_authenticator, http_authorize
    from coordinator.agents.door import DoorRefused
    from coordinator.auth import process_authenticator
    from protos import admin_pb2, admin_pb2_grpc

    path = tmp_path / "tokens.yaml"
    path.write_text(
        "tokens:\n  - {name: both, token: tok-both, scopes: [generate, admin], rate_per_s: 0.001, burst: 3}\n"
    )
    run = load_run_config(overrides=["run_id=shared-limit", f"agent.tokens_file={path}"])

    async def body() -> None:
        client, keys = aioredis.Redis.from_url(redis_url), RedisKeys(run.run_id)
        scheduler = Scheduler(run, Fleet([]), TrajectoryStreamWriter(client, keys), EchoTask(), 20)
        reporter = MetricsReporter(scheduler, None, scheduler.queue, client, keys)
        core = AdminCore(run, scheduler, reporter, ControlChannel(client, keys), None)
        server, port = await start_admin_server(core, "127.0.0.1", 0)
        agent_auth = agent_authenticator(run.agent)
        assert agent_auth is process_authenticator(run.agent)  # the admin server's too
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            admin = admin_pb2_grpc.CoordinatorAdminStub(channel)
            await admin.GetStatus(admin_pb2.GetStatusRequest(), metadata=call_metadata("tok-both"), timeout=10)
            agent_auth.authorize(call_metadata("tok-both"), Scope.GENERATE)  # the agent API
            assert http_authorize(agent_auth)("tok-both", "generate") == "both"  # the OpenAI door: 3 of 3 spent
            error = await refused(
                admin.GetStatus(admin_pb2.GetStatusRequest(), metadata=call_metadata("tok-both"), timeout=10)
            )
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(Refused) as agent_refusal:
            agent_auth.authorize(call_metadata("tok-both"), Scope.GENERATE)
        assert agent_refusal.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(DoorRefused) as door_refusal:
            http_authorize(agent_auth)("tok-both", "generate")
        assert door_refusal.value.status == 429
        await server.stop(0)
        await client.aclose()

    asyncio.run(body())
    path.write_text(path.read_text().replace("burst: 3", "burst: 4"))  # a changed file: a new book, new buckets
    assert process_authenticator(run.agent).book.grants[0].burst == 4
