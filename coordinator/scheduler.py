"""Scheduler: admission control, dispatch to rollout servers, scoring and in-order push.

The staleness bound (docs/architecture.md): with B groups per step and trainer version v_t, at most
(v_t + k + 1) * B groups are admitted. Groups are pushed in admission order, so group i is trained
at step i // B; it is dispatched only to a server whose version is >= i // B - k. Together these make
``v_trainer - min token version <= k`` hold for every sample, with nothing thrown away.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

import numpy as np

from coordinator.queue_writer import RolloutQueue
from coordinator.rollout_client import RolloutClient, RolloutFailed, SampleResult
from coordinator.tasks import TaskPrompt
from protos.config import CoordinatorConfig
from protos.records import Array, FinishReason, Sample, TrajectoryGroup, VersionSpan

logger = logging.getLogger(__name__)

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


@dataclass
class SchedulerStats:
    groups_admitted: int = 0
    groups_pushed: int = 0
    samples_pushed: int = 0
    tokens_generated: int = 0
    redispatches: int = 0
    groups_failed: int = 0
    reward_sum: float = 0.0
    max_staleness_at_push: int = 0


class NoServerAvailable(RuntimeError):
    """No healthy server at the required version appeared within the wait."""


class Scheduler:
    """Plain core of the coordinator; ``run_loop`` in ``__main__`` drives it."""

    def __init__(self, config: CoordinatorConfig, clients: list[RolloutClient], queue: RolloutQueue, task, total_groups: int):
        self.config = config
        self.clients = clients
        self.queue = queue
        self.task = task
        self.total_groups = total_groups
        self.trainer_version = 0
        self.stats = SchedulerStats()
        self._done: dict[int, TrajectoryGroup] = {}
        self._push_lock = asyncio.Lock()
        self._server_changed = asyncio.Event()

    # admission -----------------------------------------------------------------------------
    def admission_limit(self) -> int:
        bound = (self.trainer_version + self.config.max_staleness + 1) * self.config.groups_per_step
        return min(bound, self.total_groups)

    def can_admit(self) -> bool:
        return self.stats.groups_admitted < self.admission_limit()

    def admit(self) -> tuple[int, TaskPrompt]:
        index = self.stats.groups_admitted
        self.stats.groups_admitted += 1
        return index, self.task.next_prompt()

    def version_floor(self, index: int) -> int:
        return index // self.config.groups_per_step - self.config.max_staleness

    # dispatch ------------------------------------------------------------------------------
    def notify_fleet_changed(self) -> None:
        self._server_changed.set()

    async def pick_server(self, floor: int, exclude: set[str], timeout_s: float) -> RolloutClient:
        """Least-loaded healthy server at version >= floor; waits for one up to ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            eligible = [
                c for c in self.clients
                if c.healthy and c.policy_version >= floor and c.address not in exclude
            ] or [c for c in self.clients if c.healthy and c.policy_version >= floor]
            if eligible:
                return min(eligible, key=lambda c: c.inflight)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise NoServerAvailable(f"no healthy rollout server at policy version >= {floor} for {timeout_s}s")
            self._server_changed.clear()
            try:
                await asyncio.wait_for(self._server_changed.wait(), timeout=min(remaining, 1.0))
            except TimeoutError:
                pass

    async def produce_group(self, index: int, prompt: TaskPrompt, admitted_at_version: int) -> None:
        """Generate, score and hand over one group; re-dispatches on server failure."""
        tried: set[str] = set()
        for attempt in range(1, self.config.max_attempts + 1):
            client = await self.pick_server(self.version_floor(index), tried, self.config.request_timeout_s)
            tried.add(client.address)
            try:
                results = await client.generate(
                    prompt.prompt_token_ids, self.config.group_size, self.config.sampling,
                    self.config.request_timeout_s, request_id=f"g{index}-a{attempt}-{uuid.uuid4().hex[:6]}",
                )
            except RolloutFailed as error:
                self.stats.redispatches += 1
                logger.warning("group %d attempt %d failed (%s); re-dispatching", index, attempt, error)
                self.notify_fleet_changed()
                continue
            group = self._build_group(index, prompt, results, client, admitted_at_version)
            await self.complete(index, group)
            return
        self.stats.groups_failed += 1
        raise RolloutFailed(f"group {index} failed on {self.config.max_attempts} attempts ({sorted(tried)})")

    def _build_group(self, index, prompt: TaskPrompt, results: list[SampleResult], client, admitted_at_version) -> TrajectoryGroup:
        samples = []
        for result in results:
            reward = self.task.reward(prompt, result.token_ids)
            samples.append(
                Sample(
                    response_token_ids=Array.from_numpy(np.asarray(result.token_ids, dtype=np.int32)),
                    rollout_logprobs=Array.from_numpy(np.asarray(result.logprobs, dtype=np.float32)),
                    version_spans=[VersionSpan(v, s, e) for v, s, e in result.version_spans],
                    finish_reason=_FINISH.get(result.finish_reason, FinishReason.UNSPECIFIED),
                    reward=reward,
                    server_id=client.server_id or client.address,
                    routed_experts=None if result.routed_experts is None else Array.from_numpy(result.routed_experts),
                )
            )
            self.stats.tokens_generated += len(result.token_ids)
            self.stats.reward_sum += reward
        return TrajectoryGroup(
            group_id=f"{prompt.prompt_id}-{index}",
            prompt_id=prompt.prompt_id,
            prompt_token_ids=Array.from_numpy(np.asarray(prompt.prompt_token_ids, dtype=np.int32)),
            samples=samples,
            data_source=prompt.data_source,
            admission_index=index,
            admitted_at_version=admitted_at_version,
            created_s=time.time(),
        )

    # in-order push -------------------------------------------------------------------------
    async def complete(self, index: int, group: TrajectoryGroup) -> None:
        """Buffer a finished group and push every group that is now next in admission order."""
        self._done[index] = group
        async with self._push_lock:
            while self.stats.groups_pushed in self._done:
                ready = self._done.pop(self.stats.groups_pushed)
                await self.queue.push(ready)
                step = ready.admission_index // self.config.groups_per_step
                oldest = min(s.min_version for s in ready.samples)
                self.stats.max_staleness_at_push = max(self.stats.max_staleness_at_push, step - oldest)
                self.stats.groups_pushed += 1
                self.stats.samples_pushed += len(ready.samples)
