"""Typed errors of the agent SDK, each carrying the gRPC status code and the server's message.

``from_rpc_error`` maps a failed call to one of them; the retry rules (which codes are retried, how long the
client waits) live in ``fleetrl.agent.retry``.
"""

from __future__ import annotations

import re

import grpc

RETRY_AFTER_KEY = "retry-after-ms"
_FIELD_PREFIX = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_.\[\]]*)\s*:")


class AgentError(Exception):
    """Base of every SDK error. ``code`` is the gRPC status (None for client-side checks), ``details`` the
    server's message."""

    def __init__(self, message: str, *, code: grpc.StatusCode | None = None, details: str = ""):
        super().__init__(message)
        self.code = code
        self.details = details


class Unauthenticated(AgentError):
    """No token, or a token the server does not know (UNAUTHENTICATED)."""


class PermissionDenied(AgentError):
    """The token lacks the call's scope, or the session belongs to another token (PERMISSION_DENIED)."""


class InvalidArgument(AgentError):
    """The server refused a request field (INVALID_ARGUMENT); nothing was written.

    ``field`` is the field the server's message starts with (``"max_tokens: must be > 0"`` -> ``max_tokens``),
    None when the message names none that way.
    """

    @property
    def field(self) -> str | None:
        match = _FIELD_PREFIX.match(self.details)
        return match.group(1) if match else None


class FailedPrecondition(AgentError):
    """The session's state refuses the call (FAILED_PRECONDITION on a first attempt): it is closed, or it holds
    tokens this client has not seen (another client drives it)."""


class SessionLost(AgentError):
    """The session is gone (NOT_FOUND, abandoned by the server's idle timeout) or its record no longer extends
    the client's token history, so the client cannot continue it exactly-once."""


class ResourceExhausted(AgentError):
    """RESOURCE_EXHAUSTED: the token's rate limit, the staleness budget or the server's session limit.
    ``retry_after_s`` is the server's ``retry-after-ms`` hint, None when it sent none."""

    def __init__(self, message: str, *, code=None, details: str = "", retry_after_s: float | None = None):
        super().__init__(message, code=code, details=details)
        self.retry_after_s = retry_after_s


class AdmissionTimeout(ResourceExhausted):
    """OpenSession was refused for admission (staleness budget spent) for longer than the policy's
    ``admission_timeout_s``."""


class Unavailable(AgentError):
    """UNAVAILABLE or DEADLINE_EXCEEDED still after the retry policy's last attempt."""


class StreamInterrupted(AgentError):
    """A ``stream()`` broke after chunks were handed to the caller and the server recorded no turn: the
    session is unchanged (nothing of that turn is in it) and the caller may generate again."""


_BY_CODE: dict[grpc.StatusCode, type[AgentError]] = {
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.NOT_FOUND: SessionLost,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: Unavailable,
}


def retry_after_s(err: grpc.RpcError) -> float | None:
    """The ``retry-after-ms`` trailing metadata of a failed call, in seconds; None when absent or malformed."""
    trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == RETRY_AFTER_KEY:
            try:
                return max(0.0, int(value) / 1000.0)
            except ValueError:
                return None
    return None


def from_rpc_error(err: grpc.RpcError, method: str, note: str = "") -> AgentError:
    """The typed error of a failed call to ``method`` (AgentError itself for codes without a class)."""
    code, details = err.code(), err.details() or ""
    cls = _BY_CODE.get(code, AgentError)
    message = f"{method}: {code.name}: {details}" + (f" ({note})" if note else "")
    if cls is ResourceExhausted:
        return ResourceExhausted(message, code=code, details=details, retry_after_s=retry_after_s(err))
    return cls(message, code=code, details=details)
