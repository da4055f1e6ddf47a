"""The agent sessions' records in Redis, as the SessionBook writes them (``BookRecords``).

``BookRecords`` converts the book's sessions, turns and groups to the records of protos/records.py and writes
them through ``channels.sessions.AgentSessionStore``; a write that cannot reach Redis is refused UNAVAILABLE
(the caller applies nothing). A restarted coordinator reads them back through ``restore.restore_book``.
"""

from __future__ import annotations

import logging

import msgspec
import numpy as np

from channels.agent_sessions import AgentSessionStore
from channels.retry import UNREACHABLE
from coordinator.agents.errors import Unavailable
from coordinator.agents.groups import AgentGroup, Session, Turn
from protos.agent_records import AgentGroupRecord, AgentGroupState, AgentSessionRecord, AgentTurn
from protos.config import AgentConfig
from protos.records import Array, VersionSpan

logger = logging.getLogger(__name__)

RECORD_MARGIN_S = 60.0  # records outlive the longest a group can be open or remembered by this much


class BookRecords:
    """The book's writes: each lands before the reply that depends on it, or the call fails UNAVAILABLE."""

    def __init__(self, store: AgentSessionStore, config: AgentConfig, retention_s: float):
        self.store = store
        self.config = config
        self.retention_s = retention_s  # how long a done group's sessions are remembered

    def expire_at(self, group: AgentGroup) -> float:
        return group.created_wall + self.config.group_timeout_s + self.retention_s + RECORD_MARGIN_S

    def session(self, session: Session, **changes) -> AgentSessionRecord:
        record = AgentSessionRecord(
            session_id=session.session_id,
            owner=session.owner,
            group_uid=session.group.uid,
            server_address=session.server.address if session.server is not None else "",
            policy_version=session.policy_version,
            metadata=session.metadata,
            state=session.state,
            reward=session.reward,
            submission_id=session.submission_id,
            open_id=session.open_id,
        )
        return msgspec.structs.replace(record, **changes) if changes else record

    def group(self, group: AgentGroup, state: AgentGroupState | None = None) -> AgentGroupRecord:
        return AgentGroupRecord(
            group_uid=group.uid,
            key=group.key,
            prompt_token_ids=Array.from_numpy(np.asarray(group.prompt, dtype=np.int32)),
            temperature=group.temperature,
            task_id=group.task_id,
            admitted_at_version=group.admitted_at,
            created_s=group.created_wall,
            state=group.state if state is None else state,
        )

    async def write(self, of_group: AgentGroup, /, **records) -> None:
        """``AgentSessionStore.write`` of ``records`` (group, session, turn, ...), expiring with ``of_group``;
        UNAVAILABLE when Redis is away."""
        if records.get("group") is not None:
            records["expire_at_s"] = self.expire_at(of_group)
        try:
            await self.store.write(**records)
        except UNREACHABLE as error:
            raise Unavailable(f"the session store (Redis) is unreachable, nothing was recorded: {error}") from error

    async def write_turn(self, session: Session, index: int, turn: Turn) -> None:
        """Turn ``index`` of ``session`` with its header; a generated turn's routes supersede the previous ones."""
        routes = superseded = None
        if turn.routes is not None:
            routes = (index, Array.from_numpy(turn.routes))
            previous = next((i for i in range(index - 1, -1, -1) if session.turns[i].generated), None)
            superseded = previous if previous is not None and session.turns[previous].routes is not None else None
        record = AgentTurn(
            generated=turn.generated,
            token_ids=Array.from_numpy(np.asarray(turn.token_ids, dtype=np.int32)),
            logprobs=Array.from_numpy(np.asarray(turn.logprobs, dtype=np.float32)),
            finish_reason=turn.finish_reason,
            version_spans=[VersionSpan(*span) for span in turn.version_spans],
            server_id=turn.server_id,
            top_token_ids=_optional_array(turn.top_token_ids),
            top_logprobs=_optional_array(turn.top_logprobs),
        )
        await self.write(
            session.group,
            session=self.session(session),
            turn=(index, record),
            routes=routes,
            superseded_routes=superseded,
        )

    async def forget(self, sessions: list[Session], groups: list[AgentGroup]) -> None:
        await self.store.forget([s.session_id for s in sessions], [g.uid for g in groups])


def turn_from_record(record: AgentTurn) -> Turn:
    return Turn(
        generated=record.generated,
        token_ids=record.token_ids.to_numpy().tolist(),
        logprobs=record.logprobs.to_numpy().tolist(),
        finish_reason=record.finish_reason,
        version_spans=[(s.version, s.start, s.end) for s in record.version_spans],
        server_id=record.server_id,
        top_token_ids=None if record.top_token_ids is None else record.top_token_ids.to_numpy(),
        top_logprobs=None if record.top_logprobs is None else record.top_logprobs.to_numpy(),
    )


def _optional_array(values: np.ndarray | None) -> Array | None:
    return None if values is None else Array.from_numpy(values)
