"""Scheduler: admission control, dispatch to rollout servers, scoring and in-order push.

The staleness bound (docs/architecture.md): with B groups per step, trainer version v_t and v_0 the
trainer's version when this coordinator started, at most (v_t - v_0 + k + 1) * B - q group *slots* are
admitted, q being the groups an earlier coordinator of the run left queued (0 on a fresh run). Groups are
pushed in slot order, so slot i is trained at version v_0 + (q + i) // B; it is dispatched only to a server
whose version is >= v_0 + (q + i) // B - k. Together these make
``v_trainer - min token version <= k`` hold for every sample, with nothing thrown away. External agents' groups
keep this true by moving between slots (``ExternalGroups``, which coordinator/agents/slots.py implements): into a
dropped group's slot, and ahead of one that waits for its rewards, which takes their later slot only where it can
still be trained within the bound.

Dynamic sampling: a group whose rewards are all equal carries no GRPO signal. It is skipped (counted)
and a new prompt is drawn *for the same slot*, so the admission arithmetic above is unchanged: the
replacement is trained at the same step and dispatched under the same version floor.

The trainer keeps ``version_offset = version - steps taken`` in Redis: a restarted trainer that publishes its
weights as latest + 1 raises it (versions skipped: it restored no checkpoint, or replaying the lost steps gave other
weights), a step that published nothing (a non-finite update) lowers it by one. ``set_version_offset`` moves v_0 by each change, so the arithmetic above stays true
(without the lowering, k + 1 non-finite steps would leave no slot admissible: a stalled run).

Eval holds: when an eval round is due at version v_e, admission stops at slot (v_e - v_0) * B. The
trainer then reaches exactly v_e and waits; the round runs pinned to v_e, then admission resumes.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Protocol

import msgspec
import numpy as np

from channels.trajectory_stream import TrajectoryStreamWriter
from coordinator.fleet import Fleet
from coordinator.latency import LatencyHistogram
from coordinator.rewards import RewardResult
from coordinator.rollout_client import RolloutClient, SampleResult
from coordinator.tasks import Task, TaskPrompt
from protos.config import RunConfig
from protos.records import Array, PromptCursor, Sample, TrajectoryGroup, VersionSpan

logger = logging.getLogger(__name__)


class RunState(enum.IntEnum):
    """Values match ``fleetrl.admin.v1.RunState``."""

    RUNNING = 1
    PAUSED = 2
    DRAINING = 3
    DRAINED = 4
    FINISHED = 5


@dataclass
class SchedulerStats:
    slots_admitted: int = 0  # what the admission bound counts
    groups_admitted: int = 0  # prompts drawn: slots plus replacements of skipped groups
    groups_pushed: int = 0
    groups_skipped: int = 0  # dynamic sampling: all rewards equal
    groups_kept_uniform: int = 0  # dynamic sampling gave up on a slot after max tries
    samples_pushed: int = 0
    tokens_generated: int = 0
    reward_errors: int = 0
    reward_sum: float = 0.0
    max_staleness_at_push: int = 0
    agent_groups_dropped: int = 0  # agent groups dropped before complete (their slots were re-used)
    agent_turns_lost: int = 0  # agent turns lost to a failed server (nothing recorded; the agent retries)


class ExternalGroups(Protocol):
    """Groups generated outside the coordinator (external agents' groups) that hold slots in its push order; the
    scheduler consults them at each push (``Scheduler.attach_external``)."""

    def give_way(self, slot: int) -> bool:
        """``slot`` is next to push and nothing is buffered there: where an external group waiting for its rewards
        holds it, move that group behind a complete group buffered later (within the staleness bound) and put the
        complete group at ``slot`` (``Scheduler.renumber_own`` for one of the coordinator's own). True when moved."""
        ...

    async def group_pushed(self, slot: int, group: TrajectoryGroup) -> None:
        """``group`` was pushed from ``slot``; awaited before the next push."""
        ...


class Scheduler:
    """Plain core of the coordinator; the ``run()`` loop in ``__main__`` drives it."""

    def __init__(
        self,
        run: RunConfig,
        fleet: Fleet,
        queue: TrajectoryStreamWriter,
        task: Task,
        total_groups: int,
        start_version: int = 0,
        version_offset: int = 0,
        queued_at_start: int = 0,
        pushed_before: int = 0,
    ):
        self.run, self.config = run, run.coordinator  # shared and live: the admin API changes them in place
        self.fleet = fleet
        self.queue = queue
        self.task = task
        self.total_groups = total_groups
        self.start_version = start_version
        self.trainer_version = start_version
        self.version_offset = version_offset  # the trainer's version - steps, as last seen
        # Groups an earlier coordinator pushed that the trainer has not trained yet: they go first, so slot i is
        # the (queued + i)-th group the trainer takes from now on.
        self.queued_at_start = queued_at_start
        # Groups earlier coordinators of the run pushed: group ids number slots after them, so no id repeats across
        # restarts (the trainer drops a group whose id it has seen as a duplicate).
        self.pushed_before = pushed_before
        self.eval_hold_version: int | None = None
        self.state = RunState.RUNNING
        self.stats = SchedulerStats()
        self.in_flight: set[int] = set()
        self.buffered: dict[int, TrajectoryGroup] = {}  # slot -> finished group waiting for its turn to be pushed
        # slot of one of the coordinator's own groups, not pushed yet -> (its admission order, the task position
        # before its first draw); agent groups draw no prompt from the stream and have none
        self._cursor_at_admit: dict[int, tuple[int, dict[str, int]]] = {}
        self.external: ExternalGroups | None = None  # external agents' groups, once attached
        self._push_lock = asyncio.Lock()
        # Admission -> first request sent, per group (draws of dynamic sampling included); and the part of it that
        # was not spent waiting for a server at the group's version floor (the coordinator's own routing time).
        self.dispatch_latency = LatencyHistogram()
        self.routing_latency = LatencyHistogram()
        self._admitted_s: dict[int, float] = {}  # slot -> monotonic admission time, until its first dispatch

    def attach_external(self, external: ExternalGroups) -> None:
        """Take external groups (coordinator/agents/slots.py) into the push order; at most one set per scheduler."""
        if self.external is not None:
            raise ValueError("the scheduler has external groups attached already")
        self.external = external

    @property
    def clients(self) -> list[RolloutClient]:
        return self.fleet.clients

    def set_trainer_version(self, version: int) -> None:
        self.trainer_version = max(self.trainer_version, version)

    def set_version_offset(self, total: int) -> int:
        """Take the trainer's ``version - steps`` (RedisKeys.version_offset); returns its change since the last call.

        Every slot is then trained that many versions later (a restart skipped versions: positive) or earlier (a
        step published nothing: negative) than the slot arithmetic assumed, so its origin moves with it (admission
        limit, dispatch floors, eval hold).
        """
        shift = total - self.version_offset
        if shift == 0:
            return 0
        self.version_offset = total
        self.start_version += shift
        if self.eval_hold_version is not None:
            self.eval_hold_version += shift
        why = "skipped versions (restart)" if shift > 0 else "took steps that published nothing"
        logger.warning(
            "the trainer %s: slots move by %+d versions; slot i now trains at v%d + i // %d",
            why,
            shift,
            self.start_version,
            self.run.groups_per_step,
        )
        return shift

    # admission -----------------------------------------------------------------------------
    def admission_limit(self) -> int:
        limit = min(self.slots_before(self.trainer_version + self.run.max_staleness + 1), self.total_groups)
        if self.eval_hold_version is not None:
            limit = min(limit, self.slots_before(self.eval_hold_version))
        return max(0, limit)

    def slots_before(self, version: int) -> int:
        """How many of this coordinator's slots are trained by versions below ``version``."""
        return (version - self.start_version) * self.run.groups_per_step - self.queued_at_start

    @property
    def running(self) -> bool:
        return self.state == RunState.RUNNING

    def can_admit(self) -> bool:
        return self.running and self.stats.slots_admitted < self.admission_limit()

    def admit(self) -> tuple[int, TaskPrompt]:
        slot = self.new_slot()
        self._admitted_s[slot] = time.monotonic()
        self._cursor_at_admit[slot] = (slot, self.task.cursor())
        return slot, self.task.next_prompt()

    def new_slot(self) -> int:
        slot = self.stats.slots_admitted
        self.stats.slots_admitted += 1
        self.stats.groups_admitted += 1
        self.in_flight.add(slot)
        return slot

    def resume_cursor(self, group: TrajectoryGroup) -> PromptCursor:
        """Where a coordinator restarted after pushing ``group`` resumes the prompts: before the first draw of the
        earliest-admitted group of its own not pushed yet. Re-draws of pushed slots (dynamic sampling), and the
        prompts of groups pushed ahead of an unpushed one (a group waiting for rewards goes after them), made after
        that point are drawn again after a restart; no prompt of an unpushed slot is lost."""
        unpushed = [entry for slot, entry in self._cursor_at_admit.items() if slot != group.admission_index]
        position = min(unpushed, key=lambda entry: entry[0])[1] if unpushed else self.task.cursor()
        return PromptCursor(self.task.name, group.group_id, position)

    def own_group_id(self, prompt_id: str, slot: int) -> str:
        """The id of the coordinator's own group at ``slot``: slots number after the groups earlier coordinators of
        the run pushed, so an id never repeats across restarts (the trainer drops a repeated id as a duplicate)."""
        return f"{prompt_id}-{self.pushed_before + slot}"

    def renumber_own(self, group: TrajectoryGroup, old_slot: int, new_slot: int) -> TrajectoryGroup:
        """The coordinator's own ``group``, moved from ``old_slot`` to ``new_slot`` ahead of an external group: its id
        numbers its slot, and where its prompt was drawn goes with it."""
        self._cursor_at_admit[new_slot] = self._cursor_at_admit.pop(old_slot)
        return msgspec.structs.replace(group, group_id=self.own_group_id(group.prompt_id, new_slot))

    def train_version(self, slot: int) -> int:
        """The trainer version that will train slot ``slot``."""
        return self.start_version + (slot + self.queued_at_start) // self.run.groups_per_step

    def version_floor(self, slot: int) -> int:
        return self.train_version(slot) - self.run.max_staleness

    # operator verbs (admin API) --------------------------------------------------------------
    def pause(self) -> None:
        if self.state == RunState.RUNNING:
            self.state = RunState.PAUSED

    def resume(self) -> None:
        if self.state in (RunState.DRAINING, RunState.DRAINED):
            raise ValueError(f"the coordinator is {self.state.name.lower()}; a drain cannot be undone")
        if self.state == RunState.PAUSED:
            self.state = RunState.RUNNING

    def drain(self) -> None:
        if self.state in (RunState.RUNNING, RunState.PAUSED):
            self.state = RunState.DRAINING
        self.update_state()

    def update_state(self) -> None:
        if self.state == RunState.DRAINING and not self.in_flight:
            self.state = RunState.DRAINED
        elif self.state in (RunState.RUNNING, RunState.PAUSED) and self.stats.groups_pushed >= self.total_groups:
            self.state = RunState.FINISHED

    # producing one slot ----------------------------------------------------------------------
    async def produce_group(self, slot: int, prompt: TaskPrompt) -> None:
        """Generate, score and push the group of ``slot``; re-draws prompts of skipped groups."""
        admitted_at = self.trainer_version
        drawn_s = self._admitted_s.pop(slot, time.monotonic())
        tries = 0
        while True:
            tries += 1
            group, rewards = await self._generate_group(slot, prompt, admitted_at, drawn_s)
            uniform = max(rewards) - min(rewards) <= 1e-12
            if not (self.config.dynamic_sampling and uniform):
                break
            if tries >= self.config.dynamic_sampling_max_tries:
                self.stats.groups_kept_uniform += 1
                logger.warning(
                    "slot %d: %d groups in a row had equal rewards (%.3f); pushing the last one",
                    slot,
                    tries,
                    rewards[0],
                )
                break
            self.stats.groups_skipped += 1
            self.stats.groups_admitted += 1
            prompt, drawn_s = self.task.next_prompt(), time.monotonic()
        await self.complete(slot, group)

    def _observe_dispatch(self, drawn_s: float, waited_s: float) -> None:
        latency_s = time.monotonic() - drawn_s
        self.dispatch_latency.observe(latency_s)
        self.routing_latency.observe(max(0.0, latency_s - waited_s))

    async def _generate_group(
        self, slot: int, prompt: TaskPrompt, admitted_at: int, drawn_s: float
    ) -> tuple[TrajectoryGroup, list[float]]:
        floor = self.version_floor(slot)
        sampling = self.run.training_sampling()  # this request's settings; a live change applies to later ones
        if 0 < prompt.max_tokens < sampling.max_tokens:  # a prompt that asks for less (the tail task's)
            sampling = sampling.model_copy(update={"max_tokens": prompt.max_tokens})
        results, client = await self.fleet.generate(
            prompt.prompt_token_ids,
            self.config.group_size,
            sampling,
            accept=lambda c: c.policy_version >= floor,
            what=f"at policy version >= {floor}",
            request_id=f"g{slot}-{uuid.uuid4().hex[:6]}",
            timeout_s=self.config.request_timeout_s,
            max_attempts=self.config.max_attempts,
            on_dispatch=lambda waited_s: self._observe_dispatch(drawn_s, waited_s),
        )
        scores = await self.task.score(prompt, [r.token_ids for r in results])
        group = self._build_group(slot, prompt, results, scores, client, admitted_at, sampling.temperature)
        return group, [s.reward for s in scores]

    def _build_group(
        self,
        slot: int,
        prompt: TaskPrompt,
        results: list[SampleResult],
        scores: list[RewardResult],
        client: RolloutClient,
        admitted_at: int,
        temperature: float,
    ) -> TrajectoryGroup:
        samples = []
        for result, score in zip(results, scores, strict=True):
            samples.append(
                Sample(
                    response_token_ids=Array.from_numpy(np.asarray(result.token_ids, dtype=np.int32)),
                    rollout_logprobs=Array.from_numpy(np.asarray(result.logprobs, dtype=np.float32)),
                    version_spans=[VersionSpan(v, s, e) for v, s, e in result.version_spans],
                    finish_reason=result.finish_reason,
                    reward=score.reward,
                    server_id=client.server_id or client.address,
                    routed_experts=None if result.routed_experts is None else Array.from_numpy(result.routed_experts),
                    error=score.error or "",
                )
            )
            self.stats.tokens_generated += len(result.token_ids)
            self.stats.reward_errors += score.error is not None
        return TrajectoryGroup(
            group_id=self.own_group_id(prompt.prompt_id, slot),
            prompt_id=prompt.prompt_id,
            prompt_token_ids=Array.from_numpy(np.asarray(prompt.prompt_token_ids, dtype=np.int32)),
            samples=samples,
            data_source=prompt.data_source,
            admission_index=slot,
            admitted_at_version=admitted_at,
            created_s=time.time(),
            sampling_temperature=temperature,
        )

    # in-order push -------------------------------------------------------------------------
    async def complete(self, slot: int, group: TrajectoryGroup) -> None:
        """Buffer a finished group and push every group that is now next in slot order (a group waiting for its
        rewards lets complete groups behind it go first, within the staleness bound: ``ExternalGroups.give_way``)."""
        self.buffered[slot] = group
        await self.push_ready()

    async def push_ready(self) -> None:
        async with self._push_lock:
            while self._next_is_ready():
                slot = self.stats.groups_pushed
                ready = self.buffered[slot]
                # Taken out of the buffer only once it is on the queue: a push that fails (Redis gone past the retry
                # policy) leaves it here for the next call, instead of losing it and stalling every later slot.
                await self.queue.push(ready, self.resume_cursor(ready))
                del self.buffered[slot]
                self._cursor_at_admit.pop(slot, None)
                oldest = min(s.min_version for s in ready.samples)
                staleness = self.train_version(ready.admission_index) - oldest
                self.stats.max_staleness_at_push = max(self.stats.max_staleness_at_push, staleness)
                self.stats.groups_pushed += 1
                self.stats.samples_pushed += len(ready.samples)
                self.stats.reward_sum += sum(s.reward for s in ready.samples)
                self.in_flight.discard(ready.admission_index)
                if self.external is not None:
                    await self.external.group_pushed(slot, ready)
        self.update_state()

    def _next_is_ready(self) -> bool:
        """Whether the next slot in push order holds a finished group (an external one may give way to one)."""
        slot = self.stats.groups_pushed
        return slot in self.buffered or (self.external is not None and self.external.give_way(slot))
