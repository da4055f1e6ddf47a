"""The SDK's typed results: a generated turn, a stream chunk, an append's and a submission's answers.

``FinishReason`` and ``VersionSpan`` are the records' own (``protos.records``), so a turn reads like a rollout.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from protos import agent_pb2, rollout_pb2
from protos.records import Array, FinishReason, VersionSpan

__all__ = ["AppendResult", "FinishReason", "GeneratedTurn", "GroupState", "SubmitResult", "TurnChunk", "VersionSpan"]


class GroupState(enum.IntEnum):
    """agent.proto's GroupState (GROUP_STATE_<NAME>)."""

    UNSPECIFIED = agent_pb2.GROUP_STATE_UNSPECIFIED
    WAITING = agent_pb2.GROUP_STATE_WAITING  # more sessions or rewards to come
    QUEUED = agent_pb2.GROUP_STATE_QUEUED  # the group is on the trajectory queue
    ACCEPTED = agent_pb2.GROUP_STATE_ACCEPTED  # complete; queued once the groups admitted before it are
    SKIPPED = agent_pb2.GROUP_STATE_SKIPPED  # complete, all rewards equal: dropped by the run's dynamic sampling


@dataclass(frozen=True)
class GeneratedTurn:
    """One model turn as the server recorded it.

    ``recovered`` is True when the reply was lost and the turn was read back with GetSession (the record holds
    the same tokens, logprobs, finish reason, version spans and routed experts).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    version_spans: list[VersionSpan]
    routed_experts: np.ndarray | None  # [session tokens - 1, layers, top_k]
    turn_index: int
    session_length: int  # tokens the session holds after this turn
    recovered: bool = False
    # generate(top_logprobs=k), k > 0: each token's k most likely tokens and their logprobs by the engine's rank,
    # int32 / float32 [tokens, k] (answers only: never trained on); None when k was 0
    top_token_ids: np.ndarray | None = field(default=None, repr=False)
    top_logprobs: np.ndarray | None = field(default=None, repr=False)


@dataclass(frozen=True)
class TurnChunk:
    """New tokens of a streamed turn; ``turn`` is set on the last chunk (``finished``)."""

    token_ids: list[int]
    logprobs: list[float]
    turn_index: int
    session_length: int
    finished: bool = False
    turn: GeneratedTurn | None = field(default=None, repr=False)
    top_token_ids: np.ndarray | None = field(default=None, repr=False)  # [new tokens, k] as in GeneratedTurn
    top_logprobs: np.ndarray | None = field(default=None, repr=False)


@dataclass(frozen=True)
class AppendResult:
    turn_index: int
    session_length: int


@dataclass(frozen=True)
class SubmitResult:
    group_state: GroupState
    sessions_submitted: int  # of the group, this session included
    group_size: int
    group_id: str  # the trajectory group's id on the queue


def tensor_to_numpy(tensor: rollout_pb2.Tensor) -> np.ndarray | None:
    """A proto Tensor as numpy (read-only view of its bytes); None when the message is unset."""
    if not tensor.dtype:
        return None
    return Array(data=tensor.data, dtype=tensor.dtype, shape=tuple(tensor.shape)).to_numpy()


def top_arrays(token_ids, logprobs, tokens: int, k: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """agent.proto's row-major top_token_ids / top_logprobs of ``tokens`` tokens as [tokens, k] arrays; None, None
    when k is 0."""
    if k <= 0:
        return None, None
    shape = (tokens, k)
    return np.asarray(token_ids, dtype=np.int32).reshape(shape), np.asarray(logprobs, dtype=np.float32).reshape(shape)


def submit_result(response: agent_pb2.SubmitResponse) -> SubmitResult:
    return SubmitResult(
        group_state=GroupState(response.group_state),
        sessions_submitted=response.sessions_submitted,
        group_size=response.group_size,
        group_id=response.group_id,
    )
