"""How sessions and groups end (``sessions.SessionBook`` delegates here): abandoned by their agent or when idle,
dropped when their last session leaves or their group times out, forgotten once done.

Every second ``expire`` abandons sessions idle past ``agent.session_timeout_s``, drops groups not complete after
``agent.group_timeout_s`` and groups waiting for rewards that can no longer be trained within the staleness bound
(their slots go to other groups), forgets done groups' sessions ``DONE_RETENTION_S``
after their last call (in Redis too), and records a push whose record could not be written when it happened.
"""

from __future__ import annotations

import logging
import time

from channels.retry import UNREACHABLE
from coordinator.agents.errors import Unavailable
from coordinator.agents.groups import AgentGroup, BookTables, Session, SessionState
from coordinator.agents.slots import AgentSlots
from coordinator.agents.store import BookRecords
from coordinator.agents.submissions import Submissions
from coordinator.scheduler import SchedulerStats
from protos.agent_records import AgentGroupState
from protos.config import AgentConfig

logger = logging.getLogger(__name__)

ABANDONED_BY_AGENT = "abandoned by its agent"
# A done group's sessions are remembered this long after their last call (from a restart, after it), so that a
# Submit replayed after a lost reply gets its first answer; the SDK's retries fit well inside.
DONE_RETENTION_S = 30.0


class Endings:
    """Abandoning, dropping and forgetting; ``sessions``, ``groups``, ``opened`` and ``completing`` are the book's own
    tables (``sessions.SessionBook``)."""

    def __init__(
        self,
        config: AgentConfig,
        records: BookRecords,
        slots: AgentSlots,
        stats: SchedulerStats,
        submissions: Submissions,
        tables: BookTables,
    ):
        self.config = config
        self.records = records
        self.slots = slots
        self.stats = stats  # agent_groups_dropped
        self.submissions = submissions  # records pushes whose record failed at the push
        self.sessions = tables.sessions
        self.groups = tables.groups
        self.opened = tables.opened
        self.completing = tables.completing

    async def expire(self, now: float | None = None) -> None:
        """Abandon idle sessions, drop groups that can no longer complete, forget what is done (about once a
        second); record what the scheduler pushed while Redis was away."""
        now = time.monotonic() if now is None else now
        forgotten: list[Session] = []
        for session in list(self.sessions.values()):
            idle, group = now - session.last_active, session.group
            if session.busy:
                continue
            if session.state in (SessionState.OPEN, SessionState.CLOSED) and not group.done:
                if idle > self.config.session_timeout_s:
                    await self._abandon_idle(session, idle)
            elif group.done and idle > DONE_RETENTION_S:
                forgotten.append(session)
        for group in list(self.groups.values()):
            if now - group.created > self.config.group_timeout_s:
                async with group.lock:
                    await self.drop_group(group, f"not complete after {self.config.group_timeout_s:.0f}s")
            elif self.slots.waiting_is_stale(group.slot):
                await self._drop_stale(group)
        for group_id, group in list(self.completing.items()):
            if group.pushed:  # its PUSHED record failed when it was pushed
                await self.submissions.record_pushed(group_id)
        await self._forget(forgotten)

    async def _drop_stale(self, group: AgentGroup) -> None:
        async with group.lock:
            if self.slots.waiting_is_stale(group.slot):  # still so now the lock is held (no reward came meanwhile)
                await self.drop_group(group, "stale: it can no longer be trained within max_staleness")

    async def _abandon_idle(self, session: Session, idle: float) -> None:
        async with session.group.lock:
            if session.state not in (SessionState.OPEN, SessionState.CLOSED) or session.busy or session.group.done:
                return  # it moved on while the lock was awaited
            try:
                await self.abandon_session(session, f"idle {idle:.0f}s")
            except Unavailable as error:  # the next round tries again
                logger.warning("agent session %s idle, not abandoned yet: %s", session.session_id, error)

    async def _forget(self, sessions: list[Session]) -> None:
        groups: list[AgentGroup] = []
        for session in sessions:
            self.sessions.pop(session.session_id, None)
            self.opened.pop((session.owner, session.open_id), None)
            session.group.remembered -= 1
            if session.group.remembered == 0:
                groups.append(session.group)
        if not sessions:
            return
        try:
            await self.records.forget(sessions, groups)
        except UNREACHABLE as error:  # their keys expire on their own
            logger.warning("forgetting %d agent sessions in Redis failed: %s", len(sessions), error)

    async def abandon_session(self, session: Session, why: str) -> None:
        """Group lock held. The group is dropped with its last session (in the same write)."""
        group = session.group
        last = not group.done and list(group.sessions) == [session.session_id] and not group.opening
        group_record = self.records.group(group, AgentGroupState.DROPPED) if last else None
        await self.records.write(
            group, session=self.records.session(session, state=SessionState.ABANDONED), group=group_record
        )
        session.state = SessionState.ABANDONED
        group.sessions.pop(session.session_id, None)
        logger.info("agent session %s %s", session.session_id, why)
        if last:  # nobody left in it: its slot goes to another group
            await self.drop_group(group, why if why == ABANDONED_BY_AGENT else f"every session abandoned ({why})", True)

    async def drop_if_empty(self, group: AgentGroup, why: str, locked: bool = False) -> None:
        """Drop a group left with no session and none being opened (its first session failed to open)."""
        if group.sessions or group.opening or group.done:
            return
        if locked:
            await self.drop_group(group, why)
            return
        async with group.lock:
            if not group.sessions and not group.opening and not group.done:
                await self.drop_group(group, why)

    async def drop_group(self, group: AgentGroup, why: str, recorded: bool = False) -> None:
        """Group lock held. Applied even when its record cannot be written (logged): a stalled slot would stop the
        run, and a coordinator restarted meanwhile restores the group and drops it again when it times out."""
        if group.done:
            return
        if not recorded:
            try:
                await self.records.write(group, group=self.records.group(group, AgentGroupState.DROPPED))
            except Unavailable as error:
                logger.error("agent group %s dropped, its record not updated: %s", group.group_id, error)
        group.dropped = True
        for session in list(group.sessions.values()):
            session.state = SessionState.ABANDONED
        self.groups.pop((group.owner, group.key), None)
        await self.slots.release(group.slot)
        self.stats.agent_groups_dropped += 1
        # an agent abandoning its own group is routine (info); a timeout or a missing server is worth a warning
        level = logging.INFO if why == ABANDONED_BY_AGENT else logging.WARNING
        logger.log(level, "agent group %r of %s dropped (%s); slot %d re-used", group.key, group.owner, why, group.slot)
