"""The agent API's records in memory (turns, sessions, groups) and the trajectory group built from a complete group.

The trajectory of a session is its prompt and its turns up to the last generated one (appended tokens after it
are context for nothing and are dropped). Generated tokens are trained (loss mask 1, the engine's logprobs and
versions), appended ones are not (mask 0, logprob 0, no version). Routed experts are those of the last generated
turn: the engine returns them for every token before the turn's last, which is the whole trajectory but its last
token, exactly the rows R3 replays (so a session keeps only its last generated turn's).
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from coordinator.agents.errors import InvalidArgument
from protos.agent_records import AgentGroupState
from protos.agent_records import AgentSessionState as SessionState
from protos.records import Array, FinishReason, Sample, TrajectoryGroup, VersionSpan

if TYPE_CHECKING:
    from coordinator.rollout_client import RolloutClient
    from coordinator.scheduler import SchedulerStats
    from coordinator.tasks import TaskPrompt
    from protos.config import CoordinatorConfig

__all__ = [
    "AgentGroup",
    "BookTables",
    "GroupState",
    "Session",
    "SessionState",
    "Turn",
    "build_trajectory_group",
    "oldest_version",
]


class GroupState(enum.IntEnum):
    """What Submit answers; the values are ``fleetrl.agent.v1.GroupState``'s."""

    WAITING = 1  # more sessions or rewards to come
    QUEUED = 2  # on the trajectory stream
    ACCEPTED = 3  # complete, handed to the scheduler; queued once the groups admitted before it are
    SKIPPED = 4  # complete with equal rewards: dropped by dynamic sampling (no GRPO signal), its slot re-used


@dataclass
class Turn:
    generated: bool  # True: the engine's tokens (trained); False: appended by the agent
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason = FinishReason.UNSPECIFIED
    version_spans: list[tuple[int, int, int]] = field(default_factory=list)  # over this turn's tokens
    routes: np.ndarray | None = None  # [tokens before this turn's last, layers, top_k]; last generated turn only
    server_id: str = ""
    top_token_ids: np.ndarray | None = None  # int32 [T, k]: the engine's top k per token, when the turn asked for k
    top_logprobs: np.ndarray | None = None  # float32 [T, k], the same tokens' logprobs (answers only, not trained)


@dataclass
class Session:
    session_id: str
    owner: str  # the token's grant name: only it may use the session
    group: AgentGroup
    prompt: list[int]
    server: RolloutClient | None  # None after its server failed: the next turn picks another
    policy_version: int
    metadata: dict[str, str]
    turns: list[Turn] = field(default_factory=list)
    state: SessionState = SessionState.OPEN
    last_active: float = field(default_factory=time.monotonic)
    reward: float | None = None
    submission_id: str = ""
    busy: bool = False  # a turn or an append is being recorded
    open_id: str = ""  # the client's idempotency key of OpenSession

    @property
    def length(self) -> int:
        return len(self.prompt) + sum(len(t.token_ids) for t in self.turns)

    def tokens(self) -> list[int]:
        return self.prompt + [token for turn in self.turns for token in turn.token_ids]

    def last_generated(self) -> Turn | None:
        return next((turn for turn in reversed(self.turns) if turn.generated), None)


@dataclass
class AgentGroup:
    """The sessions of one (owner, group key): one GRPO group, one scheduler slot."""

    uid: str
    owner: str
    key: str
    size: int
    prompt: list[int]
    temperature: float
    slot: int
    admitted_at: int  # trainer version at admission
    task_id: str = ""  # the dataset prompt it answers ('' = its agents brought the prompt)
    task_prompt: TaskPrompt | None = None
    created: float = field(default_factory=time.monotonic)
    created_wall: float = field(default_factory=time.time)
    sessions: dict = field(default_factory=dict)  # session id -> Session (abandoned ones leave)
    opening: int = 0  # sessions being opened (their server is being picked)
    complete: bool = False  # every session submitted with a reward: handed to the scheduler
    dropped: bool = False  # abandoned, timed out, or skipped by dynamic sampling: its slot was released
    skipped: bool = False  # dropped by dynamic sampling
    pushed: bool = False  # on the trajectory stream
    remembered: int = 0  # its sessions the book still holds (a done group's are kept to answer replays)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)  # its state changes and their records

    @property
    def done(self) -> bool:
        return self.complete or self.dropped

    @property
    def group_id(self) -> str:
        """Its trajectory group's id: owner and key (two teams' keys never collide) and a part of its uid, never
        the slot, which a restart or the scheduler may change."""
        key = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{self.owner}.{self.key}")
        return f"agent-{key}-{self.uid[:12]}"

    @property
    def state(self) -> AgentGroupState:
        if self.skipped:
            return AgentGroupState.SKIPPED
        if self.dropped:
            return AgentGroupState.DROPPED
        if self.complete:
            return AgentGroupState.PUSHED if self.pushed else AgentGroupState.COMPLETE
        return AgentGroupState.OPEN

    def submitted(self) -> list:
        return [s for s in self.sessions.values() if s.state == SessionState.SUBMITTED]

    def check_joins(self, prompt: list[int], size: int, temperature: float | None, task_id: str) -> None:
        """A new session of this group must repeat its task, prompt, size and temperature, and find room."""
        if task_id != self.task_id:
            raise InvalidArgument(f"task_id: group {self.key!r} answers task {self.task_id!r}, not {task_id!r}")
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


@dataclass
class BookTables:
    """The SessionBook's tables, shared with the helpers it delegates to (submissions, endings)."""

    sessions: dict[str, Session] = field(default_factory=dict)  # every session remembered, by id
    groups: dict[tuple[str, str], AgentGroup] = field(default_factory=dict)  # open groups by (owner, group key)
    opened: dict[tuple[str, str], str] = field(default_factory=dict)  # (owner, open_id) -> session id
    completing: dict[str, AgentGroup] = field(default_factory=dict)  # group id -> complete, not known on the stream


class UniformGroups:
    """Dynamic sampling for agent groups, by the coordinator's own settings (``coordinator.dynamic_sampling``, read
    live): a complete group whose rewards are all equal carries no GRPO signal and is skipped (its slot released as
    for a dropped group) unless it is the ``dynamic_sampling_max_tries``-th in a row, which is kept (counted), so a
    run whose agents all score alike still trains."""

    def __init__(self, config: CoordinatorConfig, stats: SchedulerStats):
        self.config = config  # live: the admin API changes it in place
        self.stats = stats  # groups_skipped, groups_kept_uniform
        self.in_a_row = 0  # uniform agent groups skipped since the last one kept

    def skips(self, rewards: list[float]) -> bool:
        """Whether a group of these rewards is skipped; changes nothing (``count`` does, once it is recorded)."""
        uniform = max(rewards) - min(rewards) <= 1e-12
        return self.config.dynamic_sampling and uniform and self.in_a_row + 1 < self.config.dynamic_sampling_max_tries

    def count(self, rewards: list[float], skipped: bool) -> None:
        uniform = max(rewards) - min(rewards) <= 1e-12
        if skipped:
            self.in_a_row += 1
            self.stats.groups_skipped += 1
        elif self.config.dynamic_sampling and uniform:
            self.in_a_row = 0
            self.stats.groups_kept_uniform += 1
        else:
            self.in_a_row = 0


def session_sample(session: Session, reward: float) -> Sample:
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


def oldest_version(sessions: list[Session]) -> int:
    """The oldest token version of these sessions' trajectories, as ``Sample.min_version`` measures it (-1 for a
    session with none): what the staleness of their group is counted from."""
    return min(
        min((v for turn in s.turns if turn.generated for v, _, _ in turn.version_spans), default=-1) for s in sessions
    )


def build_trajectory_group(group: AgentGroup, sessions: list[Session]) -> TrajectoryGroup:
    """The queue's unit for a complete agent group; a task's group names the task's prompt."""
    prompt_id = group.task_prompt.prompt_id if group.task_prompt else f"agent:{group.owner}:{group.key}"
    return TrajectoryGroup(
        group_id=group.group_id,
        prompt_id=prompt_id,
        prompt_token_ids=Array.from_numpy(np.asarray(group.prompt, dtype=np.int32)),
        samples=[session_sample(s, s.reward) for s in sessions],
        data_source=f"agent:{group.owner}",
        admission_index=group.slot,
        admitted_at_version=group.admitted_at,
        created_s=time.time(),
        sampling_temperature=group.temperature,
    )
