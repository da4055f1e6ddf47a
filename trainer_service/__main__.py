"""``python -m trainer_service train --config run.json --model DIR --redis-url URL``: the trainer role.

Several ranks (backend megatron, ``trainer.num_processes`` > 1): ``python -m torch.distributed.run --standalone
--nproc-per-node N -m trainer_service train ...``. Every rank runs ``run``; rank 0 alone talks to Redis
(``RedisSide``) and hands each step's groups and every operator command to the others (``ranks``).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from functools import partial
from pathlib import Path

logger = logging.getLogger("trainer_service")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainer_service", description=__doc__)
    parser.add_argument("command", choices=["train"])
    parser.add_argument("--config", default=None)
    parser.add_argument("--model", required=True)
    parser.add_argument("--redis-url", required=True)
    parser.add_argument(
        "--linger-s", type=float, default=60.0, help="keep serving weights this long after the last step"
    )
    parser.add_argument("overrides", nargs="*")
    return parser.parse_intermixed_args(argv)


def checkpoint_root(config) -> Path:
    if config.trainer.ckpt_dir:
        return Path(config.trainer.ckpt_dir)
    return Path(config.out_dir or Path("runs") / config.run_id) / "checkpoints"


def make_backend(model_path: str, config):
    """The configured backend on the GPU when there is one (the CPU otherwise)."""
    import torch

    tcfg, temperature = config.trainer, config.coordinator.sampling.temperature
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if tcfg.backend == "megatron":
        from trainer_service.megatron_backend import MegatronBackend

        return MegatronBackend(model_path, tcfg, temperature=temperature, device=device)
    from trainer_service.torch_backend import TorchBackend

    return TorchBackend(model_path, tcfg, temperature=temperature, device=device)


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


def run(args: argparse.Namespace, stop: threading.Event) -> None:
    """The trainer loop, the same on every rank; rank 0 alone talks to Redis (``RedisSide``, ``ranks``)."""
    import torch

    from protos.config import load_run_config
    from trainer_service import ranks
    from trainer_service.checkpoint import CheckpointManager, TrainerState
    from trainer_service.trainer import Trainer

    config = load_run_config(args.config, args.overrides)
    tcfg, ccfg = config.trainer, config.coordinator
    torch.set_num_threads(1)

    # 0) restore every rank from the same checkpoint (rank 0 resolves it); rank 0 opens Redis and takes over the
    #    entries a dead trainer left pending; versions published past the checkpoint are caught up
    backend = make_backend(args.model, config)
    checkpoints = CheckpointManager(checkpoint_root(config), tcfg.keep_last_checkpoints)
    restored = ranks.resolve_checkpoint(checkpoints, tcfg.resume)
    state = CheckpointManager.load(restored, backend) if restored else TrainerState(step=0, policy_version=0)
    trainer = Trainer(
        backend,
        ccfg.max_staleness,
        state.policy_version,
        ledger=state.ledger,
        mini_batches=tcfg.mini_batches,
        measure_replay_mismatch=tcfg.measure_replay_mismatch,
    )
    side = RedisSide(args, config, trainer, stop) if ranks.world_rank() == 0 else None
    publisher = side.publisher if side else None

    def publish_current() -> float:  # collective: every rank exports, rank 0 sends
        return ranks.publish_weights(publisher, backend, trainer.policy_version)

    feed = ranks.OrderFeed(side.read_groups if side else None, partial(apply_commands, trainer, publish_current))
    if side:
        side.feed = feed
    catch_up_published(side, trainer, publish_current, restored, state.step)
    for step in range(state.step + 1, tcfg.num_steps + 1):
        started = time.monotonic()
        # 1) one step's new groups: rank 0 pops them (entries already in the ledger are skipped but acknowledged
        #    later) and acts on operator commands while it waits; every rank gets the same groups
        groups = feed.next_groups(stop)
        if groups is None:
            break
        wait_s = time.monotonic() - started
        # 2) check policy lag and 3) take the optimizer step (inside Trainer.step, alike on every rank)
        previous_version = trainer.policy_version
        values = trainer.step(groups)
        # 4) publish weights v+1 if the step was taken; a step that was not moves the coordinator's slot map back
        publish_s = publish_current() if trainer.policy_version != previous_version else 0.0
        if side and trainer.policy_version == previous_version:
            record_version_offset(side, trainer.policy_version, step)
        # 5) checkpoint (every rank its shard, rank 0 the ledger), then rank 0 acknowledges what it holds
        ckpt_s = 0.0
        if step % tcfg.ckpt_interval == 0 or step == tcfg.num_steps:
            ckpt_started = time.monotonic()
            ranks.save_checkpoint(
                checkpoints, backend, TrainerState(step, trainer.policy_version, trainer.ledger, _totals(trainer))
            )
            if side:
                side.ack_consumed()
            ckpt_s = time.monotonic() - ckpt_started
        # 6) log and report
        if side:
            side.report(
                step, values, wait_s=wait_s, publish_s=publish_s, checkpoint_s=ckpt_s, step_s=time.monotonic() - started
            )
    if side:
        side.finish(args.linger_s, stop)


def record_version_offset(side, policy_version: int, step: int) -> None:
    """Set the run's ``version_jumps`` to ``policy_version - step`` (RedisKeys.version_jumps), the coordinator's key to
    which version trains which slot. A SET of the value: repeating it (a restart before the publish) changes nothing."""
    side.client.set(side.keys.version_jumps, policy_version - step)


def catch_up_published(side, trainer, publish_current, restored, step: int) -> None:
    """Versions past the checkpoint died with the previous trainer; versions only go up, so the restored weights
    go out as the next one and the fleet moves onto them (every rank takes part in the export)."""
    from trainer_service import metrics, ranks

    published = side.published_version() if side else None
    if ranks.world_size() > 1:
        published = ranks.broadcast_json(published)
    if side:
        logger.info(
            "trainer start: step %d, policy_version=%d (checkpoint %s), published v%d, %d entries reclaimed, "
            "ledger %d groups, %d ranks",
            step,
            trainer.policy_version,
            restored,
            published,
            side.reclaimed,
            len(trainer.ledger),
            ranks.world_size(),
        )
    if published > trainer.policy_version:
        if side:  # before the publish: the coordinator must not see the new version without the jump
            record_version_offset(side, published + 1, step)
        trainer.policy_version = published + 1
        publish_current()
    elif side:
        record_version_offset(side, trainer.policy_version, step)
    if side:
        side.client.setnx(side.keys.policy_version, trainer.policy_version)
        metrics.POLICY_VERSION.set(trainer.policy_version)


class RedisSide:
    """Rank 0's Redis: the queue (read, reclaim, ack, trim), control commands, the publisher, metrics reports."""

    def __init__(self, args: argparse.Namespace, config, trainer, stop: threading.Event):
        import redis

        from protos.redis_keys import RedisKeys
        from trainer_service.publisher import WeightPublisher
        from trainer_service.queue import TrajectoryQueue

        self.config = config
        self.trainer = trainer
        self.stop = stop
        if config.trainer.metrics_port:
            from prometheus_client import start_http_server

            start_http_server(config.trainer.metrics_port)
        self.client = redis.Redis.from_url(args.redis_url, socket_timeout=30)
        self.keys = RedisKeys(config.run_id)
        self.queue = TrajectoryQueue(self.client, self.keys, trim=config.trainer.trim_acknowledged)
        self.reclaimed = self.queue.reclaim_pending()
        self.publisher = WeightPublisher(self.client, self.keys, config.weight_bus)
        self.control = ControlReader(self.client, self.keys, trainer, publish=None)
        self.feed = None  # ranks.OrderFeed: hands control commands to every rank
        self.unacked: list[str] = []  # entries consumed since the last checkpoint

    def published_version(self) -> int:
        return int(self.client.get(self.keys.policy_version) or 0)

    def poll_control(self) -> None:
        self.feed.relay_commands(*self.control.read())

    def read_groups(self) -> list:
        self.poll_control()
        tcfg = self.config.trainer
        return read_new_groups(
            self.queue,
            self.trainer,
            self.config.coordinator.groups_per_step,
            tcfg.batch_timeout_s,
            self.unacked,
            self.poll_control,
            stop=self.stop,
        )

    def ack_consumed(self) -> None:
        """After the checkpoint that holds them is complete on every rank (``ranks.save_checkpoint``)."""
        self.queue.ack(self.unacked)
        self.unacked.clear()

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
        metrics.record_step(values, trainer.last_staleness)
        metrics.QUEUE_DEPTH.set(values["queue_depth"])
        metrics.POLICY_VERSION.set(trainer.policy_version)
        report = MetricsReport("trainer", step, trainer.policy_version, time.time(), values)
        send_report(self.client, self.keys, report)
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
        from protos.records import MetricsReport

        done = MetricsReport("trainer", -1, self.trainer.policy_version, time.time(), {"done": 1.0})
        send_report(self.client, self.keys, done)
        stop.wait(linger_s)  # keep serving the last versions so slow rollout servers can fetch them
        self.publisher.close()


def send_report(client, keys, report, timeout_s: float = 30.0) -> None:
    """XADD a trainer metrics report, retried while Redis is unreachable; after ``timeout_s`` it is dropped (logged):
    a lost report costs a dashboard point, an exit would cost a model reload."""
    import redis

    from protos.records import encode
    from trainer_service.queue import retry_until_reachable

    payload = encode(report)
    try:
        retry_until_reachable(
            lambda: client.xadd(keys.metrics("trainer"), {"m": payload}, maxlen=100000, approximate=True),
            f"metrics report of step {report.step}",
            timeout_s,
        )
    except (redis.ConnectionError, redis.TimeoutError) as error:
        logger.error(
            "metrics report of step %d dropped, Redis unreachable for %.0fs: %s", report.step, timeout_s, error
        )


def _totals(trainer) -> dict[str, float]:
    totals = trainer.totals
    return {
        "samples_trained": totals.samples_trained,
        "stale_dropped": totals.stale_dropped,
        "duplicates_skipped": totals.duplicates_skipped,
        "steps_skipped": totals.steps_skipped,
    }


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
        if key == "coordinator.max_staleness":
            trainer.max_staleness = int(value)
        elif key == "coordinator.sampling.temperature":
            trainer.backend.temperature = float(value)
        else:
            return  # a setting of another role
    except (ValueError, TypeError) as error:  # a malformed command must not stop training
        logger.error("control: ignoring set %s=%r: %s", key, raw, error)
        return
    logger.info("control: %s set to %r (policy_version=%d)", key, value, trainer.policy_version)


class ControlReader:
    """Reads the run's control stream (coordinator/control.py writes it): ``sync`` and ``set`` commands.

    Rank 0 reads between steps and about once a second while a step waits for groups, so an operator's command
    is seen even while the queue is empty (a paused coordinator, an eval round); ``ranks.OrderFeed`` hands the
    commands to every rank, which act on them at that point (a ``sync`` is a collective export). ``poll`` reads
    and acts in one go (one process).
    """

    def __init__(self, client, keys, trainer, publish):
        self.client = client
        self.keys = keys
        self.trainer = trainer
        self.publish = publish  # () -> None: re-publish the current weights under the current version
        self.last_id = "0-0"
        last = client.xrevrange(keys.control, count=1)
        if last:  # start after what is already there: old commands were meant for an earlier trainer
            self.last_id = last[0][0]

    def read(self) -> tuple[bool, list[tuple[str, str]]]:
        """The commands written since the last read: (any ``sync``, the ``set`` (key, JSON value) pairs).

        Redis unreachable: none for now (they stay in the stream and come with a later read).
        """
        import redis

        try:
            entries = self.client.xread({self.keys.control: self.last_id}, count=100) or []
        except (redis.ConnectionError, redis.TimeoutError) as error:
            logger.warning("control commands not read, Redis unreachable: %s", error)
            return False, []
        sync, settings = False, []
        for _stream, items in entries:
            for entry_id, fields in items:
                self.last_id = entry_id
                command = fields.get(b"c", b"").decode(errors="replace")
                if command == "sync":
                    sync = True
                elif command == "set":
                    key = fields.get(b"key", b"").decode(errors="replace")
                    settings.append((key, fields.get(b"value", b"null").decode(errors="replace")))
        return sync, settings

    def poll(self) -> None:
        apply_commands(self.trainer, self.publish, *self.read())


def main(argv: list[str] | None = None) -> None:
    from trainer_service import ranks

    rank = ranks.world_rank()
    # Ranks > 0 run the same steps as rank 0 and talk to no one but it: their warnings and errors are enough.
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format=f"%(asctime)s trainer[rank {rank}] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("megatron").setLevel(level)  # megatron's loggers would inherit INFO from elsewhere
    args = parse_args(sys.argv[1:] if argv is None else argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    run(args, stop)


if __name__ == "__main__":
    main()
