"""Agent groups in the scheduler's slot order: the scheduler's external groups (``scheduler.ExternalGroups``).

Groups are pushed in slot order and slot i is trained at ``train_version(i)``, which is what the staleness bound
rests on (see the scheduler's docstring). An external agent's group breaks the even pace of the coordinator's own
groups in three ways, each handled here by moving groups between slots without breaking that rule:

- dropped before it is complete (abandoned, timed out, stale, skipped by dynamic sampling): its slot goes to a
  complete agent group behind it, else to the next agent group admitted;
- complete behind a released slot: it takes the lower slot;
- waiting for its rewards (every session submitted, some with reward null): its tokens are final, so the exact
  version it may be trained by is known (oldest token + k). A complete group behind it takes its slot and is pushed
  at once, and it takes that group's slot, as long as it can still be trained there within the bound; where it
  cannot, the complete group waits (the bound's own rule). A group moved earlier is trained no later than its
  admission assumed, so its staleness can only shrink.
"""

from __future__ import annotations

import heapq
import logging
from typing import Protocol

import msgspec

from coordinator.scheduler import Scheduler
from protos.records import TrajectoryGroup

logger = logging.getLogger(__name__)


class SlotEvents(Protocol):
    """What the agent groups' owner (``sessions.SessionBook``) hears of their slots."""

    async def group_pushed(self, group_id: str) -> None:
        """Agent group ``group_id`` is on the trajectory stream; awaited before the next push, so its owner records
        it before anything else is pushed (a restart never pushes it twice)."""

    def group_moved(self, old_slot: int, new_slot: int) -> None:
        """The group waiting for rewards at ``old_slot`` now holds ``new_slot`` (a complete group went first)."""


class AgentSlots:
    """The agent groups' slots in ``scheduler``'s order; registers itself as the scheduler's external groups."""

    def __init__(self, scheduler: Scheduler, events: SlotEvents):
        self.scheduler = scheduler
        self.events = events
        self._released: list[int] = []  # slots of dropped agent groups, re-used first (heap: lowest first)
        self._complete: set[int] = set()  # slots of complete agent groups buffered in the scheduler
        self._pushed: set[str] = set()  # ids of agent groups pushed
        self._awaiting: dict[int, int] = {}  # slot of an agent group waiting for rewards -> its oldest token version
        scheduler.attach_external(self)

    def admit(self) -> int | None:
        """A slot for a group an external agent generates (``sessions.SessionBook``), or None when none is
        admissible now. A released slot comes first: it was admitted under the bound already and keeps its train
        version and version floor, so (as a dynamic-sampling re-draw) the admission arithmetic is unchanged."""
        scheduler = self.scheduler
        if self._released and scheduler.running:
            slot = heapq.heappop(self._released)
            scheduler.stats.groups_admitted += 1
            scheduler.in_flight.add(slot)
            return slot
        return scheduler.new_slot() if scheduler.can_admit() else None

    def readmit(self) -> int:
        """A slot for an agent group an earlier coordinator of the run admitted and did not push (restored from
        Redis at start, before any new admission): taken whatever the bound says, as it was admitted under it."""
        return self.scheduler.new_slot()

    async def release(self, slot: int) -> None:
        """An agent group was dropped before it was complete. Its slot goes to a completed agent group buffered behind
        it (whose slot is released in turn), else to the next group admitted. Moving a group to an earlier slot trains
        it no later than its admission assumed, so its staleness can only shrink; without the move, every later group
        would wait for a new admission to fill the hole (groups are pushed in slot order)."""
        in_flight, buffered = self.scheduler.in_flight, self.scheduler.buffered
        in_flight.discard(slot)
        self._awaiting.pop(slot, None)
        while behind := [t for t in self._complete if t > slot]:
            later = min(behind)
            self._complete.discard(later)
            in_flight.discard(later)
            buffered[slot] = msgspec.structs.replace(buffered.pop(later), admission_index=slot)
            self._complete.add(slot)
            in_flight.add(slot)
            slot = later
        heapq.heappush(self._released, slot)
        await self.scheduler.push_ready()

    async def complete(self, slot: int, group: TrajectoryGroup) -> None:
        """Buffer a complete agent group; it takes the lowest released slot below its own (which is released)."""
        self._awaiting.pop(slot, None)
        if self._released and self._released[0] < slot:
            lower = heapq.heappushpop(self._released, slot)
            self.scheduler.in_flight.discard(slot)
            self.scheduler.in_flight.add(lower)
            slot = lower
        self._complete.add(slot)
        await self.scheduler.complete(slot, msgspec.structs.replace(group, admission_index=slot))

    async def wait_rewards(self, slot: int, oldest_version: int) -> None:
        """The agent group of ``slot`` has all its sessions submitted (its tokens are final, the oldest generated at
        ``oldest_version``) and waits for rewards: complete groups behind it may go first (see the module docstring)."""
        self._awaiting[slot] = oldest_version
        await self.scheduler.push_ready()

    def waiting_is_stale(self, slot: int) -> bool:
        """Whether the agent group waiting for rewards at ``slot`` can no longer be trained within the bound (the
        trainer skipped versions, or ``max_staleness`` was lowered): it is dropped rather than trained stale."""
        oldest = self._awaiting.get(slot)
        return oldest is not None and self.scheduler.train_version(slot) - oldest > self.scheduler.run.max_staleness

    def is_pushed(self, group_id: str) -> bool:
        """Whether the agent group ``group_id`` is on the trajectory stream (not only buffered in slot order)."""
        return group_id in self._pushed

    # scheduler.ExternalGroups ---------------------------------------------------------------------------------------
    def give_way(self, slot: int) -> bool:
        """When ``slot`` (the next to push, nothing buffered there) holds a group waiting for rewards, swap it with the
        first complete group behind it if the waiting group can be trained within the bound at that group's slot;
        True when swapped (``slot`` then holds that complete group)."""
        scheduler, buffered = self.scheduler, self.scheduler.buffered
        oldest = self._awaiting.get(slot)
        behind = [t for t in buffered if t > slot] if oldest is not None else []
        if not behind:
            return False
        later = min(behind)
        if scheduler.train_version(later) - oldest > scheduler.run.max_staleness:
            return False  # pushed first, it would leave the waiting group no slot it can be trained at
        group = buffered.pop(later)
        if later in self._complete:
            self._complete.discard(later)
            self._complete.add(slot)
        else:
            group = scheduler.renumber_own(group, later, slot)
        buffered[slot] = msgspec.structs.replace(group, admission_index=slot)
        self._awaiting[later] = self._awaiting.pop(slot)
        self.events.group_moved(slot, later)
        logger.info("slot %d waits for its rewards: the complete group of slot %d goes first", slot, later)
        return True

    async def group_pushed(self, slot: int, group: TrajectoryGroup) -> None:
        """The scheduler pushed ``group`` from ``slot``: an agent group's owner records it."""
        if slot in self._complete:
            self._complete.discard(slot)
            self._pushed.add(group.group_id)
        if group.group_id in self._pushed:
            await self.events.group_pushed(group.group_id)
