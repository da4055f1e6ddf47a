"""Bearer tokens with scopes and rate limits, and TLS, for the coordinator's gRPC APIs (agent and admin).

The token file (``agent.tokens_file``, else ``$FLEETRL_TOKENS_FILE``; never in the repo) lists grants::

    tokens:
      - {name: team-a, token_sha256: <64 hex>, scopes: [generate, submit], rate_per_s: 20, burst: 40}
      - {name: ops, token: <plain>, scopes: [admin], rate_per_s: 5}

A call carries ``authorization: Bearer <token>``. Refusals (protos/agent.proto's header): UNAUTHENTICATED (no,
malformed or unknown token; the token is never echoed), PERMISSION_DENIED (scope missing), RESOURCE_EXHAUSTED
(rate limit, with ``retry-after-ms`` trailing metadata). ``Authenticator.check`` is for handlers that check
themselves; ``ScopeInterceptor`` guards every method of a server with one scope. The client side (the header and
the CA a client trusts) is ``launcher/auth_client.py``. See docs/auth.md.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import yaml

from protos.config.agent import AgentConfig

TOKENS_FILE_ENV = "FLEETRL_TOKENS_FILE"
RETRY_AFTER_KEY = "retry-after-ms"
_FIELDS = {"name", "token", "token_sha256", "scopes", "rate_per_s", "burst"}
_HEX64 = re.compile(r"[0-9a-f]{64}")


class Scope(enum.StrEnum):
    GENERATE = "generate"  # OpenSession, Generate, Append, CloseSession, GetSession
    SUBMIT = "submit"  # Submit, SetReward
    ADMIN = "admin"  # the admin API


class TokenFileError(ValueError):
    """The token file is unreadable or one of its entries is invalid; the message names the entry and field."""


@dataclass(frozen=True)
class Grant:
    """One caller: its name (used for session ownership and logs), what it may do and how often."""

    name: str
    scopes: frozenset[Scope]
    rate_per_s: float
    burst: float
    token_sha256: bytes = field(repr=False)


def token_digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class TokenBook:
    """The loaded grants; a token is found by its sha256 digest, compared with ``hmac.compare_digest``."""

    def __init__(self, grants: Sequence[Grant], source: str = ""):
        self.grants = tuple(grants)
        self.source = source

    def find(self, token: str) -> Grant | None:
        digest, found = token_digest(token), None
        for grant in self.grants:  # no early exit: the time taken does not depend on which grant matched
            if hmac.compare_digest(digest, grant.token_sha256):
                found = grant
        return found

    @classmethod
    def load(cls, path: str | Path) -> TokenBook:
        try:
            data = yaml.safe_load(Path(path).read_text())
        except OSError as error:
            raise TokenFileError(f"token file {path}: cannot read it: {error}") from error
        except yaml.YAMLError as error:  # only where and what: the YAML's own message quotes the line (a token)
            mark = getattr(error, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(error, "problem", None) or "invalid YAML"
            raise TokenFileError(f"token file {path}: not valid YAML{at}: {problem}") from None
        if not isinstance(data, dict) or set(data) != {"tokens"} or not isinstance(data["tokens"], list):
            raise TokenFileError(f"token file {path}: expected one key 'tokens' holding a list of grants")
        grants: list[Grant] = []
        for index, entry in enumerate(data["tokens"]):
            grant = _parse_grant(entry, f"token file {path}: tokens[{index}]")
            where = f"token file {path}: tokens[{index}] ({grant.name})"
            if any(g.name == grant.name for g in grants):
                raise TokenFileError(f"{where}: name: duplicate name {grant.name!r}")
            twin = next((g for g in grants if hmac.compare_digest(g.token_sha256, grant.token_sha256)), None)
            if twin is not None:
                raise TokenFileError(f"{where}: token: the same token as {twin.name!r}; give each grant its own")
            grants.append(grant)
        return cls(grants, str(path))


def _parse_grant(entry: object, where: str) -> Grant:
    """One entry of the file, every field checked; errors say ``<file>: tokens[i] (name): <field>: <problem>``."""
    if not isinstance(entry, dict):
        raise TokenFileError(f"{where}: expected a mapping with name, token or token_sha256, scopes, rate_per_s")
    name = entry.get("name")
    if not isinstance(name, str) or not name.strip():
        raise TokenFileError(f"{where}: name: required, a non-empty string")
    where = f"{where} ({name})"
    unknown = sorted(set(entry) - _FIELDS, key=str)
    if unknown:
        raise TokenFileError(f"{where}: {unknown[0]}: unknown field (known: {', '.join(sorted(_FIELDS))})")
    token, hashed = entry.get("token"), entry.get("token_sha256")
    if (token is None) == (hashed is None):
        raise TokenFileError(f"{where}: token: give exactly one of token or token_sha256")
    if token is not None:
        if not isinstance(token, str) or not token or any(c.isspace() for c in token):
            raise TokenFileError(f"{where}: token: a non-empty string without whitespace")
        digest = token_digest(token)
    else:
        if not isinstance(hashed, str) or not _HEX64.fullmatch(hashed.lower()):
            raise TokenFileError(f"{where}: token_sha256: 64 hex digits (sha256sum of the token)")
        digest = bytes.fromhex(hashed)
    scopes = entry.get("scopes")
    if not isinstance(scopes, list) or not scopes:
        raise TokenFileError(f"{where}: scopes: required, a non-empty list of {[s.value for s in Scope]}")
    for scope in scopes:
        if scope not in {s.value for s in Scope}:
            raise TokenFileError(f"{where}: scopes: unknown scope {scope!r} (known: {[s.value for s in Scope]})")
    rate = _positive(entry.get("rate_per_s"), f"{where}: rate_per_s")
    burst = _positive(entry.get("burst", max(1.0, rate)), f"{where}: burst")
    if burst < 1:
        raise TokenFileError(f"{where}: burst: at least 1 (calls a caller may make at once), got {burst}")
    return Grant(name, frozenset(Scope(s) for s in scopes), rate, burst, digest)


def _positive(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise TokenFileError(f"{where}: required, a number > 0 (calls per second), got {value!r}")
    return float(value)


def tokens_file(agent: AgentConfig) -> str:
    """The configured token file: ``agent.tokens_file``, else ``$FLEETRL_TOKENS_FILE``, else ''."""
    return agent.tokens_file or os.environ.get(TOKENS_FILE_ENV, "")


def configured_token_book(agent: AgentConfig) -> TokenBook | None:
    """The token book of the configured file, or None when no file is configured."""
    path = tokens_file(agent)
    return TokenBook.load(path) if path else None


_PROCESS_AUTHENTICATORS: dict[tuple[str, bytes], Authenticator] = {}


def process_authenticator(agent: AgentConfig) -> Authenticator | None:
    """This process's one Authenticator of the configured token file (None when none is configured).

    Every API a process serves (the admin API, the agent API, the OpenAI door) checks tokens through it, so a
    token's rate limit is spent once per call whichever API it calls. The file is read at each call; the same
    content (by path and sha256) gets the same Authenticator, a changed file a new one (new buckets).
    """
    path = tokens_file(agent)
    if not path:
        return None
    try:
        content = Path(path).read_bytes()
    except OSError as error:
        raise TokenFileError(f"token file {path}: cannot read it: {error}") from error
    key = (str(Path(path).resolve()), hashlib.sha256(content).digest())
    if key not in _PROCESS_AUTHENTICATORS:
        _PROCESS_AUTHENTICATORS[key] = Authenticator(TokenBook.load(path))
    return _PROCESS_AUTHENTICATORS[key]


class RateLimiter:
    """A token bucket per grant: ``burst`` calls at once, refilled at ``rate_per_s``."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # grant name -> (tokens, time of the last refill)

    def take(self, grant: Grant) -> float:
        """Spend one call of ``grant``'s budget: 0.0 if allowed, else the seconds until one is available."""
        now = self.clock()
        tokens, last = self._buckets.get(grant.name, (grant.burst, now))
        tokens = min(grant.burst, tokens + (now - last) * grant.rate_per_s)
        if tokens >= 1.0:
            self._buckets[grant.name] = (tokens - 1.0, now)
            return 0.0
        self._buckets[grant.name] = (tokens, now)
        return (1.0 - tokens) / grant.rate_per_s


class Refused(Exception):
    """A call the authenticator refuses: its gRPC code, a message safe to send, and a retry delay if any."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_ms: int = 0):
        super().__init__(message)
        self.code, self.message, self.retry_after_ms = code, message, retry_after_ms


def bearer_token(metadata: Sequence[tuple[str, str | bytes]] | None) -> str:
    """The token of ``authorization: Bearer <token>``; raises Refused (UNAUTHENTICATED) without echoing it."""
    values = [v for k, v in metadata or () if k.lower() == "authorization"]
    if not values:
        raise Refused(
            grpc.StatusCode.UNAUTHENTICATED, "no authorization metadata: send 'authorization: Bearer <token>'"
        )
    value = values[0].decode(errors="replace") if isinstance(values[0], bytes) else values[0]
    scheme, _, token = value.strip().partition(" ")
    token = token.strip()
    if len(values) > 1 or scheme.lower() != "bearer" or not token or any(c.isspace() for c in token):
        raise Refused(grpc.StatusCode.UNAUTHENTICATED, "malformed authorization metadata: expected 'Bearer <token>'")
    return token


class Authenticator:
    """Who is calling (the token), may they (the scope), and not too often (the grant's rate limit)."""

    def __init__(self, book: TokenBook, clock: Callable[[], float] = time.monotonic):
        self.book = book
        self.limiter = RateLimiter(clock)

    def authorize(self, metadata: Sequence[tuple[str, str | bytes]] | None, scope: Scope) -> Grant:
        """The caller's grant for a call needing ``scope``; raises Refused. The plain core of ``check``."""
        grant = self.book.find(bearer_token(metadata))
        if grant is None:
            raise Refused(grpc.StatusCode.UNAUTHENTICATED, "unknown bearer token")
        if scope not in grant.scopes:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, f"token {grant.name!r} lacks scope {scope.value!r}")
        wait_s = self.limiter.take(grant)
        if wait_s > 0:
            retry_ms = max(1, math.ceil(wait_s * 1000 - 1e-6))  # - 1e-6: 150.00000000000003 ms is 150
            message = (
                f"rate limit of token {grant.name!r} ({grant.rate_per_s:g}/s, burst {grant.burst:g}) exceeded; "
                f"retry after {retry_ms} ms"
            )
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, message, retry_ms)
        return grant

    async def check(self, context: grpc.aio.ServicerContext, scope: Scope) -> Grant:
        """The caller's grant; on refusal aborts the call (UNAUTHENTICATED, PERMISSION_DENIED, RESOURCE_EXHAUSTED)."""
        try:
            return self.authorize(context.invocation_metadata(), scope)
        except Refused as refusal:
            await abort_refused(context, refusal)
            raise  # not reached: abort raises


async def abort_refused(context: grpc.aio.ServicerContext, refusal: Refused) -> None:
    if refusal.retry_after_ms:
        await abort_exhausted(context, refusal.message, refusal.retry_after_ms)
    else:
        await context.abort(refusal.code, refusal.message)


async def abort_exhausted(context: grpc.aio.ServicerContext, message: str, retry_after_ms: int) -> None:
    """Abort with RESOURCE_EXHAUSTED and ``retry-after-ms`` trailing metadata (rate limits, admission)."""
    await context.abort(
        grpc.StatusCode.RESOURCE_EXHAUSTED, message, trailing_metadata=((RETRY_AFTER_KEY, str(retry_after_ms)),)
    )


class ScopeInterceptor(grpc.aio.ServerInterceptor):
    """Every method of the server needs ``scope``; a refused call gets its code and nothing of the handler runs."""

    def __init__(self, authenticator: Authenticator, scope: Scope):
        self.authenticator, self.scope = authenticator, scope

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)  # looks the handler up; runs nothing of it
        if handler is None:
            return None  # unknown method: UNIMPLEMENTED as without the interceptor
        try:
            self.authenticator.authorize(handler_call_details.invocation_metadata, self.scope)
        except Refused as refusal:
            return _refusing(handler, refusal)
        return handler


def _refusing(handler: grpc.RpcMethodHandler, refusal: Refused) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that only aborts with ``refusal``."""

    async def unary(request, context):
        await abort_refused(context, refusal)

    async def streaming(request, context):
        await abort_refused(context, refusal)
        yield  # not reached; makes this an async generator, as a streaming handler is

    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    behavior = streaming if handler.response_streaming else unary
    return make(behavior, handler.request_deserializer, handler.response_serializer)


def server_credentials(cert_file: str, key_file: str) -> grpc.ServerCredentials:
    """TLS credentials of a PEM certificate (chain) and its private key."""
    return grpc.ssl_server_credentials([(Path(key_file).read_bytes(), Path(cert_file).read_bytes())])


def add_port(server: grpc.aio.Server, address: str, agent: AgentConfig) -> int:
    """Bind ``address`` with TLS when ``agent.tls_cert_file``/``tls_key_file`` are set, else plaintext; the port
    bound (0 when it could not be)."""
    if agent.tls_cert_file:
        return server.add_secure_port(address, server_credentials(agent.tls_cert_file, agent.tls_key_file))
    return server.add_insecure_port(address)
