"""``restore_book`` rebuilds the SessionBook from its records in Redis (``store.BookRecords``) when the coordinator
starts:

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

from channels.agent_sessions import StoredSession
from coordinator.agents.errors import InvalidArgument
from coordinator.agents.groups import AgentGroup, Session, SessionState
from coordinator.agents.sessions import SessionBook
from coordinator.agents.store import turn_from_record
from coordinator.fleet import Fleet
from protos.agent_records import AgentGroupRecord, AgentGroupState

logger = logging.getLogger(__name__)


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


def _session(stored: StoredSession, group: AgentGroup, fleet: Fleet) -> Session:
    record = stored.record
    session = Session(
        session_id=record.session_id,
        owner=record.owner,
        group=group,
        prompt=list(group.prompt),
        server=fleet.find(record.server_address) if record.server_address else None,
        policy_version=record.policy_version,
        metadata=dict(record.metadata),
        turns=[turn_from_record(turn) for turn in stored.turns],
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


async def restore_book(book: SessionBook, last_pushed_id: str | None) -> None:
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
        group.slot = book.slots.readmit()
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
