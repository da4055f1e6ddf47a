"""The coordinator's admin API: ``AdminCore`` (plain, callable in-process) and a thin gRPC servicer.

Served on ``coordinator.admin_host:admin_port`` as ``fleetrl.admin.v1.CoordinatorAdmin``; the
``fleetrl status|pause|resume|drain|set|sync|servers`` commands are its client (``admin_cli``).
Errors of the core map to gRPC codes: unknown key or server -> NOT_FOUND, bad value ->
INVALID_ARGUMENT, not allowed now (or a rollout server to add is unreachable) -> FAILED_PRECONDITION.
With a token file configured, every call needs a bearer token of scope ``admin`` (``coordinator.auth``,
docs/auth.md); without one the API is open.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

import grpc

from coordinator.auth import TOKENS_FILE_ENV, Scope, ScopeInterceptor, add_port, process_authenticator
from coordinator.control import ControlChannel
from coordinator.evaluation import EvalRunner
from coordinator.metrics import MetricsReporter
from coordinator.rollout_client import RolloutFailed
from coordinator.runtime_config import FixedSetting, apply_setting
from coordinator.scheduler import RunState, Scheduler
from protos import admin_pb2 as pb
from protos import admin_pb2_grpc as pb_grpc
from protos.config import RunConfig

logger = logging.getLogger(__name__)

# Settings the trainer also reads; a change is announced on the control stream.
TRAINER_KEYS = {"max_staleness", "temperature"}


class Conflict(Exception):
    """The request is valid but not allowed in the coordinator's current state."""


@dataclass
class AdminCore:
    run_config: RunConfig
    scheduler: Scheduler
    reporter: MetricsReporter
    control: ControlChannel
    evals: EvalRunner | None

    def status(self) -> pb.GetStatusResponse:
        s, stats, cfg = self.scheduler, self.scheduler.stats, self.scheduler.config
        servers = [
            pb.ServerStatus(
                address=c.address,
                server_id=c.server_id,
                healthy=c.healthy,
                policy_version=c.policy_version,
                inflight=c.inflight,
                requests=c.requests,
                failures=c.failures,
            )
            for c in s.fleet.clients
        ]
        evals = self.evals
        return pb.GetStatusResponse(
            run_id=self.run_config.run_id,
            state=int(s.state),
            trainer_policy_version=s.trainer_version,
            start_policy_version=s.start_version,
            max_staleness=self.run_config.max_staleness,
            groups_per_step=self.run_config.groups_per_step,
            group_size=cfg.group_size,
            groups_admitted=stats.groups_admitted,
            slots_admitted=stats.slots_admitted,
            admission_limit=s.admission_limit(),
            groups_pushed=stats.groups_pushed,
            total_groups=s.total_groups,
            groups_in_flight=len(s.in_flight),
            groups_skipped=stats.groups_skipped,
            redispatches=s.fleet.redispatches,
            queue_depth=self.reporter.queue_depth,
            max_staleness_at_push=stats.max_staleness_at_push,
            tokens_per_s=self.reporter.tokens_per_s,
            groups_per_s=self.reporter.groups_per_s,
            uptime_s=time.monotonic() - self.reporter.started,
            servers=servers,
            eval=evals.latest if evals else {},
            eval_version=evals.latest_version if evals else -1,
            next_eval_version=evals.pending[0] if evals and evals.pending else -1,
            task=cfg.task,
        )

    def pause(self) -> RunState:
        self.scheduler.pause()
        logger.info("admin: paused (admitting nothing; %d groups in flight)", len(self.scheduler.in_flight))
        return self.scheduler.state

    def resume(self) -> RunState:
        try:
            self.scheduler.resume()
        except ValueError as error:
            raise Conflict(str(error)) from error
        logger.info("admin: resumed")
        return self.scheduler.state

    async def drain(self, wait_s: float) -> RunState:
        self.scheduler.drain()
        logger.info("admin: draining (%d groups in flight)", len(self.scheduler.in_flight))
        deadline = time.monotonic() + wait_s
        while self.scheduler.state != RunState.DRAINED and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return self.scheduler.state

    async def set(self, key: str, raw_value: str) -> tuple[str, object, object, str]:
        """Apply ``key=raw_value`` to the live config; returns (key, old, new, control entry id or '')."""
        key, old, new = apply_setting(self.run_config, key, raw_value)
        entry_id = ""
        if key in TRAINER_KEYS:
            entry_id = await self.control.announce_setting(key, new)
        logger.info("admin: set %s = %r (was %r)", key, new, old)
        return key, old, new, entry_id

    async def add_server(self, address: str):
        try:
            return await self.scheduler.fleet.add(address)
        except ValueError as error:  # already in the fleet
            raise Conflict(str(error)) from error
        except grpc.aio.AioRpcError as error:
            raise RolloutFailed(f"rollout server {address}: {error.code().name}: {error.details()}") from error

    def remove_server(self, address: str):
        try:
            return self.scheduler.fleet.remove(address)
        except ValueError as error:  # the last server
            raise Conflict(str(error)) from error


_CODES = (
    (LookupError, grpc.StatusCode.NOT_FOUND),
    (Conflict, grpc.StatusCode.FAILED_PRECONDITION),
    (FixedSetting, grpc.StatusCode.FAILED_PRECONDITION),
    (RolloutFailed, grpc.StatusCode.FAILED_PRECONDITION),  # UNAVAILABLE would read as "coordinator unreachable"
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
)


async def _answer(context: grpc.aio.ServicerContext, call):
    """Await ``call``; a core error becomes the gRPC status of its kind (anything else propagates)."""
    try:
        return await call
    except tuple(kind for kind, _ in _CODES) as error:
        code = next(code for kind, code in _CODES if isinstance(error, kind))
        message = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
        await context.abort(code, message)


async def _sync(fn, *args):
    """A plain core call as an awaitable, for ``_answer``."""
    return fn(*args)


class AdminServicer(pb_grpc.CoordinatorAdminServicer):
    """Thin adapter: request -> AdminCore call -> response."""

    def __init__(self, core: AdminCore):
        self.core = core

    async def GetStatus(self, request, context):
        return self.core.status()

    async def Pause(self, request, context):
        return pb.PauseResponse(state=int(self.core.pause()))

    async def Resume(self, request, context):
        state = await _answer(context, _sync(self.core.resume))
        return pb.ResumeResponse(state=int(state))

    async def Drain(self, request, context):
        state = await self.core.drain(request.wait_s)
        stats = self.core.scheduler.stats
        return pb.DrainResponse(
            state=int(state), groups_in_flight=len(self.core.scheduler.in_flight), groups_pushed=stats.groups_pushed
        )

    async def SetConfig(self, request, context):
        key, old, new, entry_id = await _answer(context, self.core.set(request.key, request.value))
        return pb.SetConfigResponse(
            key=key, old_value=json.dumps(old), new_value=json.dumps(new), control_entry_id=entry_id
        )

    async def Sync(self, request, context):
        result = await self.core.control.request_sync(request.wait_s)
        return pb.SyncResponse(
            control_entry_id=result.control_entry_id, published=result.published, policy_version=result.policy_version
        )

    async def AddServer(self, request, context):
        client = await _answer(context, self.core.add_server(request.address))
        return pb.AddServerResponse(
            server_id=client.server_id,
            policy_version=client.policy_version,
            num_servers=len(self.core.scheduler.fleet.clients),
        )

    async def RemoveServer(self, request, context):
        client = await _answer(context, _sync(self.core.remove_server, request.address))
        return pb.RemoveServerResponse(num_servers=len(self.core.scheduler.fleet.clients), inflight=client.inflight)


async def start_admin_server(core: AdminCore, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Serve the admin API on ``host:port`` (0 picks a free port); returns the server and its port.

    With a token file configured (``agent.tokens_file`` or ``$FLEETRL_TOKENS_FILE``) every call needs a token of
    scope ``admin``; without one the API is open (the local demo). TLS when ``agent.tls_cert_file`` is set.
    """
    agent = core.run_config.agent
    authenticator = process_authenticator(agent)  # the agent API's too: one rate limit per token and process
    book = authenticator.book if authenticator is not None else None
    interceptors = [ScopeInterceptor(authenticator, Scope.ADMIN)] if authenticator is not None else []
    server = grpc.aio.server(interceptors=interceptors)
    pb_grpc.add_CoordinatorAdminServicer_to_server(AdminServicer(core), server)
    try:
        bound = add_port(server, f"{host}:{port}", agent)
    except RuntimeError as error:
        raise OSError(
            f"coordinator.admin_port {port} on {host} cannot be bound (in use?); "
            "choose another port or 0 for a free one"
        ) from error
    if bound == 0:
        raise OSError(f"coordinator.admin_port {port} on {host} cannot be bound (in use?)")
    tls = " over TLS" if agent.tls_cert_file else ""
    if book is None:
        logger.warning("admin API%s is open: no token file (agent.tokens_file or $%s)", tls, TOKENS_FILE_ENV)
    else:
        logger.info("admin API%s needs scope admin (%d tokens from %s)", tls, len(book.grants), book.source)
    await server.start()
    return server, bound
