"""Agent groups in the scheduler's slot order (a mixin of ``scheduler.Scheduler``).

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

import msgspec

from protos.records import TrajectoryGroup

logger = logging.getLogger(__name__)


class ExternalSlots:
    """Mixin of Scheduler: its ``running``, ``stats``, ``in_flight``, ``run``, ``_done``, ``_new_slot``, ``can_admit``,
    ``complete``, ``_push_ready``, ``train_version``, ``own_group_id`` and ``_cursor_at_admit``."""

    def _init_external_slots(self) -> None:
        self._released: list[int] = []  # slots of dropped agent groups, re-used first (heap: lowest first)
        self._external_done: set[int] = set()  # slots of complete agent groups buffered in _done
        self._pushed_external: set[str] = set()  # ids of agent groups pushed
        self._awaiting: dict[int, int] = {}  # slot of an agent group waiting for rewards -> its oldest token version
        # async (group id) -> None, awaited after an agent group's push and before the next push: the agent API
        # records that its group is on the stream (coordinator/agents/sessions.py), so a restart never pushes it twice
        self.on_external_pushed = None
        # (old slot, new slot) -> None, called when a group waiting for rewards moves behind a complete one: the agent
        # API completes or drops it at its new slot
        self.on_external_moved = None

    def admit_external(self) -> int | None:
        """A slot for a group an external agent generates (coordinator/agents/sessions.py), or None when none is
        admissible now. A released slot comes first: it was admitted under the bound already and keeps its train
        version and version floor, so (as a dynamic-sampling re-draw) the admission arithmetic is unchanged."""
        if self._released and self.running:
            slot = heapq.heappop(self._released)
            self.stats.groups_admitted += 1
            self.in_flight.add(slot)
            return slot
        return self._new_slot() if self.can_admit() else None

    def readmit_external(self) -> int:
        """A slot for an agent group an earlier coordinator of the run admitted and did not push (restored from
        Redis at start, before any new admission): taken whatever the bound says, as it was admitted under it."""
        return self._new_slot()

    async def release_slot(self, slot: int) -> None:
        """An agent group was dropped before it was complete. Its slot goes to a completed agent group buffered behind
        it (whose slot is released in turn), else to the next group admitted. Moving a group to an earlier slot trains
        it no later than its admission assumed, so its staleness can only shrink; without the move, every later group
        would wait for a new admission to fill the hole (groups are pushed in slot order)."""
        self.in_flight.discard(slot)
        self._awaiting.pop(slot, None)
        while behind := [t for t in self._external_done if t > slot]:
            later = min(behind)
            self._external_done.discard(later)
            self.in_flight.discard(later)
            self._done[slot] = msgspec.structs.replace(self._done.pop(later), admission_index=slot)
            self._external_done.add(slot)
            self.in_flight.add(slot)
            slot = later
        heapq.heappush(self._released, slot)
        await self._push_ready()

    async def complete_external(self, slot: int, group: TrajectoryGroup) -> None:
        """Buffer a complete agent group; it takes the lowest released slot below its own (which is released)."""
        self._awaiting.pop(slot, None)
        if self._released and self._released[0] < slot:
            lower = heapq.heappushpop(self._released, slot)
            self.in_flight.discard(slot)
            self.in_flight.add(lower)
            slot = lower
        self._external_done.add(slot)
        await self.complete(slot, msgspec.structs.replace(group, admission_index=slot))

    async def wait_rewards(self, slot: int, oldest_version: int) -> None:
        """The agent group of ``slot`` has all its sessions submitted (its tokens are final, the oldest generated at
        ``oldest_version``) and waits for rewards: complete groups behind it may go first (see the module docstring)."""
        self._awaiting[slot] = oldest_version
        await self._push_ready()

    def waiting_is_stale(self, slot: int) -> bool:
        """Whether the agent group waiting for rewards at ``slot`` can no longer be trained within the bound (the
        trainer skipped versions, or ``max_staleness`` was lowered): it is dropped rather than trained stale."""
        oldest = self._awaiting.get(slot)
        return oldest is not None and self.train_version(slot) - oldest > self.run.max_staleness

    def pushed(self, group_id: str) -> bool:
        """Whether the agent group ``group_id`` is on the trajectory stream (not only buffered in slot order)."""
        return group_id in self._pushed_external

    def _overtake(self, slot: int) -> bool:
        """When ``slot`` (the next to push) holds a group waiting for rewards, swap it with the first complete group
        behind it if the waiting group can be trained within the bound at that group's slot; True when swapped."""
        oldest = self._awaiting.get(slot)
        behind = [t for t in self._done if t > slot] if oldest is not None else []
        if not behind:
            return False
        later = min(behind)
        if self.train_version(later) - oldest > self.run.max_staleness:
            return False  # pushed first, it would leave the waiting group no slot it can be trained at
        group = self._done.pop(later)
        if later in self._external_done:
            self._external_done.discard(later)
            self._external_done.add(slot)
        else:  # the coordinator's own group: its id numbers its slot, and where its prompt was drawn goes with it
            group = msgspec.structs.replace(group, group_id=self.own_group_id(group.prompt_id, slot))
            self._cursor_at_admit[slot] = self._cursor_at_admit.pop(later)
        self._done[slot] = msgspec.structs.replace(group, admission_index=slot)
        self._awaiting[later] = self._awaiting.pop(slot)
        if self.on_external_moved is not None:
            self.on_external_moved(slot, later)
        logger.info("slot %d waits for its rewards: the complete group of slot %d goes first", slot, later)
        return True
