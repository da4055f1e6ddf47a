"""Trainer: the plain core of the trainer role (no Redis): staleness check, step, publish decision.

``__main__.run`` drives it with groups popped from the queue; tests can drive it in-process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from protos.records import TrajectoryGroup
from trainer_service.batch import build_batch


def staleness_of(group: TrajectoryGroup, policy_version: int) -> int:
    """v_trainer - min token version over the group's samples (docs/architecture.md)."""
    return policy_version - min(sample.min_version for sample in group.samples)


@dataclass
class TrainerTotals:
    steps: int = 0
    samples_trained: int = 0
    stale_dropped: int = 0
    max_staleness_seen: int = 0
    steps_skipped: int = 0
    staleness_counts: dict[int, int] = field(default_factory=dict)


class Trainer:
    """Owns the backend and the policy version; ``step`` trains on one step's groups."""

    def __init__(self, backend, max_staleness: int, policy_version: int = 0):
        self.backend = backend
        self.max_staleness = max_staleness
        self.policy_version = policy_version
        self.totals = TrainerTotals()

    def step(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        """Drop groups beyond the staleness bound, train on the rest; returns the step's figures.

        The policy version advances only when the optimizer step was taken (not skipped), i.e. when
        new weights must be published.
        """
        started = time.monotonic()
        staleness = [staleness_of(g, self.policy_version) for g in groups]
        fresh = [g for g, s in zip(groups, staleness, strict=True) if s <= self.max_staleness]
        totals = self.totals
        totals.stale_dropped += sum(len(g.samples) for g, s in zip(groups, staleness, strict=True) if s > self.max_staleness)
        totals.max_staleness_seen = max(totals.max_staleness_seen, *staleness)
        for value in staleness:
            totals.staleness_counts[value] = totals.staleness_counts.get(value, 0) + 1
        values: dict[str, float] = {"skipped": 1.0, "reward_mean": 0.0}
        if fresh:
            batch = build_batch(fresh)
            values = self.backend.train_step(batch)
            values["reward_mean"] = float(batch.rewards_B.mean())
            totals.samples_trained += int(batch.rewards_B.numel())
        totals.steps += 1
        if values["skipped"]:
            totals.steps_skipped += 1
        else:
            self.policy_version += 1
        values.update(
            staleness_max=float(max(staleness)),
            staleness_mean=sum(staleness) / len(staleness),
            train_s=time.monotonic() - started,
            samples_trained=float(totals.samples_trained),
            stale_dropped=float(totals.stale_dropped),
            max_staleness_seen=float(totals.max_staleness_seen),
        )
        return values
