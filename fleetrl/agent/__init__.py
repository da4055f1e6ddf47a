"""fleetrl.agent: the Python SDK of fleetrl's agent API (protos/agent.proto).

``AsyncAgentClient`` (grpc.aio) and ``AgentClient`` (sync) open sessions; a session generates turns, appends
tool results and submits itself with a reward. It keeps its own token history and sends ``expected_length`` on
Generate/Append, so retries (``RetryPolicy``) never record a turn twice. Errors are typed (``AgentError`` and
its subclasses) and carry the gRPC code and the server's message.
"""

from fleetrl.agent.aio import AsyncAgentClient, AsyncSession, AsyncSessionContext
from fleetrl.agent.errors import (
    AdmissionTimeout,
    AgentError,
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    SessionLost,
    StreamInterrupted,
    Unauthenticated,
    Unavailable,
)
from fleetrl.agent.retry import RetryPolicy
from fleetrl.agent.session_core import SessionStatus
from fleetrl.agent.sync import AgentClient, Session, SessionContext
from fleetrl.agent.types import (
    AppendResult,
    FinishReason,
    GeneratedTurn,
    GroupState,
    SubmitResult,
    TurnChunk,
    VersionSpan,
)

__all__ = [
    "AdmissionTimeout",
    "AgentClient",
    "AgentError",
    "AppendResult",
    "AsyncAgentClient",
    "AsyncSession",
    "AsyncSessionContext",
    "FailedPrecondition",
    "FinishReason",
    "GeneratedTurn",
    "GroupState",
    "InvalidArgument",
    "PermissionDenied",
    "ResourceExhausted",
    "RetryPolicy",
    "Session",
    "SessionContext",
    "SessionLost",
    "SessionStatus",
    "StreamInterrupted",
    "SubmitResult",
    "TurnChunk",
    "Unauthenticated",
    "Unavailable",
    "VersionSpan",
]
