"""Trainer: the plain core of the trainer role (no Redis): dedupe, staleness check, step, publish decision.

``__main__.run`` drives it with groups popped from the queue; tests can drive it in-process. The ledger
(group id -> outcome) makes consumption idempotent: a group id seen before (a redelivered entry after a
crash, or a push the coordinator retried after a lost reply) is skipped and counted, never trained twice.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from protos.records import TrajectoryGroup
from trainer_service.backend import Backend
from trainer_service.batch import build_batch, split_mini_batches


def staleness_of(group: TrajectoryGroup, policy_version: int) -> int:
    """v_trainer - min token version over the group's samples (docs/architecture.md)."""
    return policy_version - min(sample.min_version for sample in group.samples)


@dataclass
class TrainerTotals:
    steps: int = 0  # optimizer steps taken (a published version each); a step that trained nothing is not one
    samples_trained: int = 0
    stale_dropped: int = 0
    max_staleness_seen: int = 0
    steps_skipped: int = 0
    duplicates_skipped: int = 0
    staleness_counts: dict[int, int] = field(default_factory=dict)


class Trainer:
    """Owns the backend, the policy version and the ledger; ``step`` trains on one step's groups."""

    def __init__(
        self,
        backend: Backend,
        max_staleness: int,
        policy_version: int = 0,
        ledger: dict[str, str] | None = None,
        mini_batches: int = 1,
        measure_replay_mismatch: bool = False,
        trained_versions: dict[str, int] | None = None,
    ):
        self.backend = backend
        self.mini_batches = mini_batches
        self.measure_replay_mismatch = measure_replay_mismatch
        self.max_staleness = max_staleness
        self.policy_version = policy_version
        self.ledger: dict[str, str] = dict(ledger or {})
        self.trained_versions: dict[str, int] = dict(trained_versions or {})  # group id -> v_trainer of its step
        self.totals = TrainerTotals()
        self.last_staleness: list[int] = []  # per group of the last step (metrics)

    def _train(self, batch, group_size: int) -> dict[str, float]:
        """One training step: one optimizer step, or ``mini_batches`` of them against a pi_old fixed here."""
        if self.mini_batches == 1:
            return self.backend.train_step(batch)
        batch.old_logprobs_BT = self.backend.policy_logprobs(batch)
        parts = [self.backend.train_step(mini) for mini in split_mini_batches(batch, self.mini_batches, group_size)]
        values = {key: sum(p[key] for p in parts) / len(parts) for key in parts[0]}
        values["skipped"] = float(all(p["skipped"] for p in parts))  # a version is published if any update ran
        values["mini_batches"] = float(len(parts))
        return values

    def _replay_mismatch(self, batch) -> dict[str, float]:
        """|trainer - rollout| logprob of the on-policy rows (staleness 0), with the rollout's routes replayed and
        with the trainer's own routing: what R3 removes of the train/inference mismatch (two extra forwards)."""
        if batch.routed_experts_BTLK is None:
            return {}
        on_policy_BT = batch.loss_mask_BT * (batch.min_versions_B == self.policy_version).float()[:, None]
        num_tokens = float(on_policy_BT.sum())
        if num_tokens == 0:
            return {}

        def mean_abs_diff(logprobs_BT) -> float:
            return float(((logprobs_BT - batch.rollout_logprobs_BT).abs() * on_policy_BT).sum()) / num_tokens

        replayed = self.backend.policy_logprobs(batch)
        natural = self.backend.policy_logprobs(dataclasses.replace(batch, routed_experts_BTLK=None))
        return {
            "on_policy_abs_logprob_diff_r3": mean_abs_diff(replayed),
            "on_policy_abs_logprob_diff_natural": mean_abs_diff(natural),
            "on_policy_tokens": num_tokens,
        }

    def filter_new(self, groups: list[TrajectoryGroup]) -> list[TrajectoryGroup]:
        """The groups not consumed before (ledger) and not repeated in ``groups``; counts the rest."""
        new: dict[str, TrajectoryGroup] = {}
        for group in groups:
            if group.group_id in self.ledger or group.group_id in new:
                self.totals.duplicates_skipped += 1
            else:
                new[group.group_id] = group
        return list(new.values())

    def step(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        """Drop groups beyond the staleness bound, train on the rest, record all of them in the ledger.

        ``groups`` must be new (see ``filter_new``). The policy version advances only when the optimizer
        step was taken (not skipped), i.e. when new weights must be published. Returns the step's figures.
        """
        started = time.monotonic()
        totals = self.totals
        if not groups or any(g.group_id in self.ledger for g in groups):
            raise ValueError("Trainer.step needs at least one group, none of them in the ledger (filter_new)")
        updated_version = self.policy_version  # v_trainer: the version this step's update starts from
        staleness = [staleness_of(g, updated_version) for g in groups]
        self.last_staleness = staleness
        fresh = [g for g, s in zip(groups, staleness, strict=True) if s <= self.max_staleness]
        totals.stale_dropped += sum(
            len(g.samples) for g, s in zip(groups, staleness, strict=True) if s > self.max_staleness
        )
        totals.max_staleness_seen = max(totals.max_staleness_seen, *staleness)
        for value in staleness:
            totals.staleness_counts[value] = totals.staleness_counts.get(value, 0) + 1
        values: dict[str, float] = {"skipped": 1.0, "reward_mean": 0.0}
        if fresh:
            batch = build_batch(fresh)
            mismatch = self._replay_mismatch(batch) if self.measure_replay_mismatch else {}
            values = {**self._train(batch, len(fresh[0].samples)), **mismatch}
            values["r3_replayed"] = float(batch.routed_experts_BTLK is not None)
            values["reward_mean"] = float(batch.rewards_B.mean())
            totals.samples_trained += int(batch.rewards_B.numel())
        if values["skipped"]:  # nothing trained (every group stale, or a non-finite update): not a step
            totals.steps_skipped += 1
        else:
            totals.steps += 1
            self.policy_version += 1
        trained = "nonfinite" if values["skipped"] else "trained"
        for group, lag in zip(groups, staleness, strict=True):
            self.ledger[group.group_id] = "stale" if lag > self.max_staleness else trained
            self.trained_versions[group.group_id] = updated_version
        values.update(
            staleness_max=float(max(staleness)),
            staleness_mean=sum(staleness) / len(staleness),
            train_s=time.monotonic() - started,
            samples_trained=float(totals.samples_trained),
            stale_dropped=float(totals.stale_dropped),
            max_staleness_seen=float(totals.max_staleness_seen),
            duplicates_skipped=float(totals.duplicates_skipped),
            samples_step=float(sum(len(g.samples) for g in fresh)),
            stale_dropped_step=float(sum(len(g.samples) for g in groups) - sum(len(g.samples) for g in fresh)),
            num_tokens=float(batch.num_response_tokens if fresh else 0),
        )
        return values
