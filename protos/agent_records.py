"""Records of external agents' sessions, kept in Redis so that a restarted coordinator serves them
(channels/agent_sessions.py). Same rules as protos/records.py: array_like msgspec structs, append-only, golden bytes
in tests/protos."""

from __future__ import annotations

import enum

import msgspec

from protos.records import Array, FinishReason, VersionSpan


class AgentSessionState(enum.IntEnum):  # an agent's session; the values are agent.proto's SessionState
    OPEN = 1
    CLOSED = 2  # finished by its agent, not submitted yet
    SUBMITTED = 3
    ABANDONED = 4


class AgentGroupState(enum.IntEnum):
    OPEN = 1  # sessions or rewards to come
    COMPLETE = 2  # every session submitted with a reward: handed to the scheduler, not on the stream yet
    PUSHED = 3  # on the trajectory stream
    DROPPED = 4  # abandoned or timed out before complete; its slot was re-used
    SKIPPED = 5  # complete with equal rewards: dropped by dynamic sampling, its slot re-used


class AgentTurn(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """One turn of an agent session. Producer: the agent API -> the coordinator restarted (channels/agent_sessions)."""

    generated: bool  # True: the engine's tokens (trained, mask 1); False: appended by the agent (mask 0)
    token_ids: Array  # int32 [T]
    logprobs: Array  # float32 [T]; zeros on an appended turn
    finish_reason: FinishReason
    version_spans: list[VersionSpan]  # over this turn's tokens
    server_id: str
    # added in v2: the engine's most likely tokens at each position when the agent asked for top_logprobs k > 0
    # (int32 / float32 [T, k], vLLM's rank order); None when it did not. Answers only: never trained on.
    top_token_ids: Array | None = None
    top_logprobs: Array | None = None


class AgentSessionRecord(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """An agent session but its turns. Producer: the agent API -> the coordinator restarted."""

    session_id: str
    owner: str  # the token's grant name: only it may use the session
    group_uid: str  # its AgentGroupRecord
    server_address: str  # the rollout server it sticks to; '' = the next turn picks one
    policy_version: int  # in force when it opened
    metadata: dict[str, str]
    state: AgentSessionState
    reward: float | None
    submission_id: str
    open_id: str  # the client's idempotency key of OpenSession


class AgentGroupRecord(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """The agent sessions of one group key: one GRPO group of the run's size. Producer: as AgentSessionRecord."""

    group_uid: str  # its TrajectoryGroup's id ends in its first 12 characters
    key: str  # the agents' group key (the owner is its sessions')
    prompt_token_ids: Array  # int32 [P]
    temperature: float
    task_id: str  # the dataset prompt it answers ('' = the agents brought the prompt)
    admitted_at_version: int  # trainer version when its first session was admitted
    created_s: float  # wall time: agent.group_timeout_s counts from here
    state: AgentGroupState
