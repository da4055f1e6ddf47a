"""An agent group's records (turns, sessions' states) and the trajectory group built from them.

The trajectory of a session is its prompt and its turns up to the last generated one (appended tokens after it
are context for nothing and are dropped). Generated tokens are trained (loss mask 1, the engine's logprobs and
versions), appended ones are not (mask 0, logprob 0, no version). Routed experts are those of the last generated
turn: the engine returns them for every token before the turn's last, which is the whole trajectory but its last
token, exactly the rows R3 replays.
"""

from __future__ import annotations

import enum
import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from coordinator.agent_errors import InvalidArgument
from protos.records import Array, FinishReason, Sample, TrajectoryGroup, VersionSpan


class GroupState(enum.IntEnum):
    """Values match ``fleetrl.agent.v1.GroupState``."""

    WAITING = 1  # more sessions or rewards to come
    QUEUED = 2  # on the trajectory stream
    ACCEPTED = 3  # complete, handed to the scheduler; queued once the groups admitted before it are


class SessionState(enum.IntEnum):
    """Values match ``fleetrl.agent.v1.SessionState``."""

    OPEN = 1
    CLOSED = 2  # finished by the agent, not submitted yet
    SUBMITTED = 3
    ABANDONED = 4


@dataclass
class Turn:
    generated: bool  # True: the engine's tokens (trained); False: appended by the agent
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason = FinishReason.UNSPECIFIED
    version_spans: list[tuple[int, int, int]] = field(default_factory=list)  # over this turn's tokens
    routes: np.ndarray | None = None  # [tokens before this turn's last, layers, top_k]
    server_id: str = ""


@dataclass
class AgentGroup:
    """The sessions of one (owner, group key): one GRPO group, one scheduler slot."""

    owner: str
    key: str
    size: int
    prompt: list[int]
    temperature: float
    slot: int
    admitted_at: int  # trainer version at admission
    created: float = field(default_factory=time.monotonic)
    sessions: dict = field(default_factory=dict)  # session id -> Session (abandoned ones leave)
    opening: int = 0  # sessions being opened (their server is being picked)
    complete: bool = False  # every session submitted with a reward: handed to the scheduler
    dropped: bool = False
    group_id: str = ""

    @property
    def done(self) -> bool:
        return self.complete or self.dropped

    def submitted(self) -> list:
        return [s for s in self.sessions.values() if s.state == SessionState.SUBMITTED]

    def check_joins(self, prompt: list[int], size: int, temperature: float | None) -> None:
        """A new session of this group must repeat its prompt, size and temperature, and find room."""
        if prompt != self.prompt:
            raise InvalidArgument(f"prompt_token_ids: group {self.key!r} has another prompt (one task per group)")
        if size != self.size:
            raise InvalidArgument(f"group_size: group {self.key!r} has size {self.size}, not {size}")
        if temperature is not None and temperature != self.temperature:
            raise InvalidArgument(
                f"sampling.temperature: group {self.key!r} samples at {self.temperature}, not {temperature}"
            )
        if len(self.sessions) + self.opening >= self.size:
            raise InvalidArgument(f"group_key: group {self.key!r} has its {self.size} sessions already")


def session_sample(session, reward: float) -> Sample:
    """The trajectory of one submitted session (see the module docstring)."""
    last = max(i for i, turn in enumerate(session.turns) if turn.generated)
    turns = session.turns[: last + 1]
    tokens, logprobs, mask, spans, offset = [], [], [], [], 0
    for turn in turns:
        tokens += turn.token_ids
        logprobs += turn.logprobs if turn.generated else [0.0] * len(turn.token_ids)
        mask += [int(turn.generated)] * len(turn.token_ids)
        spans += [VersionSpan(v, offset + start, offset + end) for v, start, end in turn.version_spans]
        offset += len(turn.token_ids)
    routes = turns[-1].routes
    if routes is not None and routes.shape[0] != len(session.prompt) + len(tokens) - 1:
        routes = None  # not the rows the trainer replays: train without R3 for this sample rather than misalign
    return Sample(
        response_token_ids=Array.from_numpy(np.asarray(tokens, dtype=np.int32)),
        rollout_logprobs=Array.from_numpy(np.asarray(logprobs, dtype=np.float32)),
        version_spans=spans,
        finish_reason=turns[-1].finish_reason,
        reward=float(reward),
        server_id=turns[-1].server_id,
        routed_experts=None if routes is None else Array.from_numpy(routes),
        loss_mask=Array.from_numpy(np.asarray(mask, dtype=np.uint8)),
    )


def build_trajectory_group(group: AgentGroup, sessions: list) -> TrajectoryGroup:
    """The queue's unit for a complete agent group. Its id keeps the owner and key (two teams' keys never collide)
    and ends in a random part, not the slot: the scheduler may move the group to an earlier slot."""
    key = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{group.owner}.{group.key}")
    return TrajectoryGroup(
        group_id=f"agent-{key}-{uuid.uuid4().hex[:12]}",
        prompt_id=f"agent:{group.owner}:{group.key}",
        prompt_token_ids=Array.from_numpy(np.asarray(group.prompt, dtype=np.int32)),
        samples=[session_sample(s, s.reward) for s in sessions],
        data_source=f"agent:{group.owner}",
        admission_index=group.slot,
        admitted_at_version=group.admitted_at,
        created_s=time.time(),
        sampling_temperature=group.temperature,
    )
