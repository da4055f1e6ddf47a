"""The agent sessions' records in Redis, as the SessionBook writes them and a restarted coordinator restores them.

``BookRecords`` converts the book's sessions, turns and groups to the records of protos/records.py and writes
them through ``channels.sessions.AgentSessionStore``; a write that cannot reach Redis is refused UNAVAILABLE
(the caller applies nothing). ``restore_book`` rebuilds the book when the coordinator starts:

- groups on the stream, dropped or skipped are remembered (a replayed Submit gets its first answer) but take no
  slot; a complete group whose id the prompt cursor names was pushed by the last push before the restart (its
  PUSHED record could not follow) and counts as pushed;
- every other group (open, or complete and not pushed yet) takes a new slot of the scheduler before any new
  admission. Slots go by the oldest token of each group (earliest deadline first): a group admitted under the
  staleness bound before the restart stays within it, since every unpushed group lies after every pushed one in
  the run's order and the restored groups take the first places after them; complete ones are handed back to the
  scheduler, which pushes them in slot order;
- sessions keep their tokens, state, reward and server (when that server is still in the fleet); their idle clock
  starts again, as agents could not call while the coordinator was down.
"""

from __future__ import annotations

import logging
import time

import msgspec
import numpy as np

from channels.agent_sessions import AgentSessionStore, StoredSession
from channels.retry import UNREACHABLE
from coordinator.agents.errors import InvalidArgument, Unavailable
from coordinator.agents.groups import AgentGroup, Session, SessionState, Turn
from protos.agent_records import AgentGroupRecord, AgentGroupState, AgentSessionRecord, AgentTurn
from protos.records import Array, VersionSpan

logger = logging.getLogger(__name__)

RECORD_MARGIN_S = 60.0  # records outlive the longest a group can be open or remembered by this much


class BookRecords:
    """The book's writes: each lands before the reply that depends on it, or the call fails UNAVAILABLE."""

    def __init__(self, store: AgentSessionStore, config, retention_s: float):
        self.store = store
        self.config = config  # AgentConfig
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


def _turn(record: AgentTurn) -> Turn:
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


def _group(record: AgentGroupRecord, owner: str, size: int) -> AgentGroup:
    age_s = max(0.0, time.time() - record.created_s)
    return AgentGroup(
        uid=record.group_uid,
        owner=owner,
        key=record.key,
        size=size,
        prompt=record.prompt_token_ids.to_numpy().tolist(),
        temperature=record.temperature,
        slot=-1,
        admitted_at=record.admitted_at_version,
        task_id=record.task_id,
        created=time.monotonic() - age_s,  # its timeout counts from its admission, across the restart
        created_wall=record.created_s,
        complete=record.state in (AgentGroupState.COMPLETE, AgentGroupState.PUSHED, AgentGroupState.SKIPPED),
        dropped=record.state == AgentGroupState.DROPPED,
        skipped=record.state == AgentGroupState.SKIPPED,
        pushed=record.state == AgentGroupState.PUSHED,
    )


def _session(stored: StoredSession, group: AgentGroup, fleet) -> Session:
    record = stored.record
    session = Session(
        session_id=record.session_id,
        owner=record.owner,
        group=group,
        prompt=list(group.prompt),
        server=fleet.find(record.server_address) if record.server_address else None,
        policy_version=record.policy_version,
        metadata=dict(record.metadata),
        turns=[_turn(turn) for turn in stored.turns],
        state=SessionState.ABANDONED if group.dropped else record.state,
        reward=record.reward,
        submission_id=record.submission_id,
        open_id=record.open_id,
    )
    if stored.routes is not None and session.turns[stored.routes[0]].generated:
        session.turns[stored.routes[0]].routes = stored.routes[1].to_numpy()
    return session


def _oldest_token(group: AgentGroup) -> float:
    versions = [v for s in group.sessions.values() for t in s.turns for v, _, _ in t.version_spans]
    return min(versions, default=float("inf"))


async def restore_book(book, last_pushed_id: str | None) -> None:
    """Rebuild ``book`` (a SessionBook with nothing in it yet) from the run's records; see the module docstring."""
    stored = await book.records.store.load()
    by_group: dict[str, list[StoredSession]] = {}
    for item in stored.sessions:
        by_group.setdefault(item.record.group_uid, []).append(item)
    size = book.scheduler.config.group_size
    restored, stale = [], [s for s in stored.sessions if s.record.group_uid not in stored.groups]
    for uid, record in stored.groups.items():
        members = by_group.get(uid, [])
        if not members or len(members) > size:  # a group of another run's size cannot be trained by this one
            stale += members
            await book.records.store.forget(group_uids=[uid])
            continue
        group = _group(record, members[0].record.owner, size)
        if record.task_id:
            try:
                group.task_prompt = book.tasks.prompt(record.task_id)
            except InvalidArgument as error:  # the run's task changed: its sessions need rewards from their agents
                logger.warning("agent group %s: %s", group.group_id, error)
        if record.state == AgentGroupState.COMPLETE and group.group_id == last_pushed_id:
            group.pushed = True  # the push before the restart; its PUSHED record could not follow
            await book.records.write(group, group=book.records.group(group))
        for item in members:
            session = _session(item, group, book.fleet)
            book.adopt(session)
        restored.append(group)
    await book.records.store.forget([s.record.session_id for s in stale])
    unpushed = (g for g in restored if g.state in (AgentGroupState.OPEN, AgentGroupState.COMPLETE))
    waiting = sorted(unpushed, key=lambda g: (_oldest_token(g), g.created_wall))
    for group in waiting:
        group.slot = book.scheduler.readmit_external()
    for group in waiting:
        await book.resume_group(group)
    if restored or stale or stored.num_undecodable:  # a restart: worth a line at warning level, as the others
        logger.warning(
            "agent sessions restored: %d sessions of %d groups (%d take slots again), %d records skipped",
            len(book.sessions),
            len(restored),
            len(waiting),
            len(stale) + stored.num_undecodable,
        )
