"""What the agent API's core refuses, by kind; ``api.py`` maps each kind to a gRPC status at the boundary."""

from __future__ import annotations


class AgentRefused(Exception):
    """A call the core refuses; ``kind`` maps to a gRPC status at the boundary (api.py)."""

    kind = "invalid"  # invalid | not_found | precondition | denied | exhausted | unavailable

    def __init__(self, message: str, retry_after_ms: int = 0):
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class InvalidArgument(AgentRefused):
    kind = "invalid"


class NotFound(AgentRefused):
    kind = "not_found"


class FailedPrecondition(AgentRefused):
    kind = "precondition"


class PermissionDenied(AgentRefused):
    kind = "denied"


class Exhausted(AgentRefused):
    kind = "exhausted"


class Unavailable(AgentRefused):
    kind = "unavailable"
