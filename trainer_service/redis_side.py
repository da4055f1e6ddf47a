"""Rank 0's side of the trainer on Redis: the trajectory queue (read, reclaim, ack, trim), operator commands on the
control stream, the weight publisher and the metrics reports. The other ranks never talk to Redis: ``ranks`` hands
them rank 0's groups and commands (``trainer_service/__main__.py`` runs the loop on every rank).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

from protos.records import RoleDone

logger = logging.getLogger("trainer_service")


def read_new_groups(
    queue, trainer, num_groups: int, timeout_s: float, entry_ids: list[str], on_wait, stop=None
) -> list:
    """Read until ``num_groups`` groups the ledger has not seen; every entry read joins ``entry_ids``.

    ``on_wait()`` runs about once a second while the queue is short (control commands). Returns [] when ``stop``
    is set meanwhile (the entries read stay pending and are reclaimed by the next trainer).
    """
    deadline = time.monotonic() + timeout_s
    groups = []
    while len(groups) < num_groups:
        if stop is not None and stop.is_set():
            return []
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(
                f"waited {timeout_s}s for {num_groups} new groups from {queue.keys.trajectories}, got {len(groups)}"
            )
        read = queue.read(num_groups - len(groups), timeout_s=min(1.0, remaining))
        entry_ids.extend(entry_id for entry_id, _ in read)
        groups.extend(trainer.filter_new([group for _, group in read]))
        if len(groups) < num_groups:
            on_wait()
    return groups


class RedisSide:
    """Rank 0's Redis: the queue (read, reclaim, ack, trim), control commands, the publisher, metrics reports."""

    def __init__(self, redis_url: str, config, trainer, stop: threading.Event):
        import redis

        from channels.control_stream import ControlStreamReader
        from channels.metrics_stream import MetricsStreamWriter
        from channels.trajectory_stream import TrajectoryStreamReader
        from channels.version_board import VersionBoard
        from protos.redis_keys import RedisKeys
        from trainer_service.publisher import WeightPublisher

        self.config = config
        self.trainer = trainer
        self.stop = stop
        if config.trainer.metrics_port:
            from trainer_service import metrics

            metrics.serve(config.trainer.metrics_port)
        self.client = redis.Redis.from_url(redis_url, socket_timeout=30)
        self.keys = RedisKeys(config.run_id)
        self.board = VersionBoard(self.client, self.keys)
        self.metrics = MetricsStreamWriter(self.client, self.keys)
        self.queue = TrajectoryStreamReader(self.client, self.keys, trim=config.trainer.trim_acknowledged)
        self.reclaimed = self.queue.reclaim_pending()
        self.publisher = WeightPublisher(self.client, self.keys, config.weight_bus)
        self.control = ControlStreamReader(self.client, self.keys)
        self.unacked: list[str] = []  # entries consumed since the last checkpoint
        # One process: the entries of checkpoints that became durable since it was last asked (CheckpointWriter);
        # asked at every poll of the wait for groups (the first at each step), so an idle trainer acknowledges too.
        self.durable_acks: Callable[[], list[str]] | None = None

    def published_version(self) -> int:
        return self.board.latest_version()

    def read_groups(self, relay) -> list:
        """The next step's new groups; ``relay(sync, settings)`` gets the operator commands read meanwhile."""

        def poll_control() -> None:
            batch = self.control.read()
            relay(batch.sync, batch.settings)
            if self.durable_acks is not None:
                self.ack(self.durable_acks())

        poll_control()
        tcfg = self.config.trainer
        return read_new_groups(
            self.queue,
            self.trainer,
            self.config.groups_per_step,
            tcfg.batch_timeout_s,
            self.unacked,
            poll_control,
            stop=self.stop,
        )

    def ack_consumed(self) -> None:
        """After the checkpoint that holds them is complete on every rank (``ranks.save_checkpoint``)."""
        self.ack(self.take_unacked())

    def take_unacked(self) -> list[str]:
        """The entries consumed since the last call: the ones the checkpoint being written holds."""
        taken, self.unacked = self.unacked, []
        return taken

    def ack(self, entry_ids: list[str]) -> None:
        """Acknowledge ``entry_ids``, once the checkpoint that holds them is durable."""
        self.queue.ack(entry_ids)

    def report(self, step: int, values: dict[str, float], **seconds: float) -> None:
        from protos.records import MetricsReport
        from trainer_service import metrics

        trainer = self.trainer
        if seconds["publish_s"]:
            metrics.PUBLISH_SECONDS.observe(seconds["publish_s"])
        if seconds["checkpoint_s"]:
            metrics.CHECKPOINT_SECONDS.observe(seconds["checkpoint_s"])
        values.update(
            seconds,
            queue_depth=float(self.queue.depth()),
            weight_versions_published=float(self.publisher.num_published),
        )
        values.update({f"staleness_groups/{k}": float(c) for k, c in trainer.totals.staleness_counts.items()})
        metrics.record_step(values, trainer.last_staleness, trainer.max_staleness)
        metrics.QUEUE_DEPTH.set(values["queue_depth"])
        metrics.POLICY_VERSION.set(trainer.policy_version)
        # retried for 30 s, then dropped (logged): a lost report costs a dashboard point, an exit a model reload
        self.metrics.post(MetricsReport("trainer", step, trainer.policy_version, time.time(), values), timeout_s=30.0)
        if values["skipped"]:
            logger.warning(
                "step %d trained nothing (%d samples stale, staleness_max=%d): no version published, policy_version=%d",
                step,
                values["stale_dropped_step"],
                values["staleness_max"],
                trainer.policy_version,
            )
            return
        logger.info(
            "step %d policy_version=%d reward=%.3f staleness_max=%d loss=%.4f step_s=%.2f",
            step,
            trainer.policy_version,
            values["reward_mean"],
            values["staleness_max"],
            values.get("loss", 0.0),
            values["step_s"],
        )

    def finish(self, linger_s: float, stop: threading.Event) -> None:
        # a lost marker (dropped after 30 s, logged) costs the launcher its wait for it, an exit a model reload
        done = RoleDone("trainer", self.trainer.totals.steps, self.trainer.policy_version, time.time())
        self.metrics.post_done(done, timeout_s=30.0)
        stop.wait(linger_s)  # keep serving the last versions so slow rollout servers can fetch them
        self.publisher.close()


def apply_commands(trainer, publish, sync: bool, settings: list[tuple[str, str]]) -> None:
    """Act on operator commands (every rank, at the same point): ``set`` first, then one ``sync``."""
    for key, value in settings:
        _apply_setting(trainer, key, value)
    if sync:
        # Same version number: the weights of version v are what the trainer holds (a skipped step
        # changed nothing), and the coordinator counts versions as steps consumed. Servers already on v
        # ignore it; stale ones catch up.
        logger.info("control: sync -> re-publishing policy_version=%d", trainer.policy_version)
        publish()


def _apply_setting(trainer, key: str, raw: str) -> None:
    try:
        value = json.loads(raw)
        if key == "max_staleness":
            trainer.max_staleness = int(value)
        elif key == "temperature":
            trainer.backend.temperature = float(value)
        else:
            return  # a setting of another role
    except (ValueError, TypeError) as error:  # a malformed command must not stop training
        logger.error("control: ignoring set %s=%r: %s", key, raw, error)
        return
    logger.info("control: %s set to %r (policy_version=%d)", key, value, trainer.policy_version)
