"""``python -m trainer_service train --config run.json --model DIR --redis-url URL``: the trainer role."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path

logger = logging.getLogger("trainer_service")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainer_service", description=__doc__)
    parser.add_argument("command", choices=["train"])
    parser.add_argument("--config", default=None)
    parser.add_argument("--model", required=True)
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--linger-s", type=float, default=60.0, help="keep serving weights this long after the last step")
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


def read_new_groups(queue, trainer, num_groups: int, timeout_s: float, entry_ids: list[str], on_wait) -> list:
    """Read until ``num_groups`` groups the ledger has not seen; every entry read joins ``entry_ids``.

    ``on_wait()`` runs about once a second while the queue is short (control commands).
    """
    deadline = time.monotonic() + timeout_s
    groups = []
    while len(groups) < num_groups:
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
    import redis
    import torch

    from protos.config import load_run_config
    from protos.records import MetricsReport, encode
    from protos.redis_keys import RedisKeys
    from trainer_service import metrics
    from trainer_service.checkpoint import CheckpointManager, TrainerState
    from trainer_service.publisher import WeightPublisher
    from trainer_service.queue import TrajectoryQueue
    from trainer_service.trainer import Trainer

    config = load_run_config(args.config, args.overrides)
    tcfg, ccfg = config.trainer, config.coordinator
    torch.set_num_threads(1)
    if tcfg.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(tcfg.metrics_port)
    client = redis.Redis.from_url(args.redis_url, socket_timeout=30)
    keys = RedisKeys(config.run_id)

    # 0) restore: backend + ledger from the checkpoint, then take over entries a dead trainer left pending
    backend = make_backend(args.model, config)
    checkpoints = CheckpointManager(checkpoint_root(config), tcfg.keep_last_checkpoints)
    restored = checkpoints.resolve(tcfg.resume)
    state = CheckpointManager.load(restored, backend) if restored else TrainerState(step=0, policy_version=0)
    trainer = Trainer(backend, ccfg.max_staleness, state.policy_version, ledger=state.ledger,
                      mini_batches=tcfg.mini_batches)
    queue = TrajectoryQueue(client, keys, trim=tcfg.trim_acknowledged)
    reclaimed = queue.reclaim_pending()
    publisher = WeightPublisher(client, keys, config.weight_bus)
    published = int(client.get(keys.policy_version) or 0)
    logger.info("trainer start: step %d, policy_version=%d (checkpoint %s), published v%d, %d entries reclaimed, "
                "ledger %d groups", state.step, trainer.policy_version, restored, published, reclaimed, len(trainer.ledger))
    if published > trainer.policy_version:
        # Versions past the checkpoint died with the previous trainer; versions only go up, so the restored
        # weights go out as the next one and the fleet moves onto them.
        trainer.policy_version = published + 1
        publisher.publish(trainer.policy_version, backend.export_hf_weights())
    client.setnx(keys.policy_version, trainer.policy_version)
    metrics.POLICY_VERSION.set(trainer.policy_version)
    unacked: list[str] = []  # entries consumed since the last checkpoint
    control = ControlReader(
        client, keys, trainer, lambda: publisher.publish(trainer.policy_version, backend.export_hf_weights())
    )
    for step in range(state.step + 1, tcfg.num_steps + 1):
        if stop.is_set():
            break
        started = time.monotonic()
        # 1) pop one step's new groups (entries already in the ledger are skipped but acknowledged later)
        groups = read_new_groups(queue, trainer, ccfg.groups_per_step, tcfg.batch_timeout_s, unacked, control.poll)
        wait_s = time.monotonic() - started
        # 2) check policy lag and 3) take the optimizer step (inside Trainer.step)
        previous_version = trainer.policy_version
        values = trainer.step(groups)
        # 4) publish weights v+1 if the step was taken; then act on operator commands (sync, set)
        publish_s = 0.0
        if trainer.policy_version != previous_version:
            publish_s = publisher.publish(trainer.policy_version, backend.export_hf_weights())
            metrics.PUBLISH_SECONDS.observe(publish_s)
        control.poll()
        # 5) checkpoint (model, optimizer, ledger), then acknowledge what it holds
        ckpt_s = 0.0
        if step % tcfg.ckpt_interval == 0 or step == tcfg.num_steps:
            ckpt_started = time.monotonic()
            checkpoints.save(backend, TrainerState(step, trainer.policy_version, trainer.ledger, _totals(trainer)))
            queue.ack(unacked)
            unacked.clear()
            ckpt_s = time.monotonic() - ckpt_started
            metrics.CHECKPOINT_SECONDS.observe(ckpt_s)
        # 6) log and report
        values.update(wait_s=wait_s, publish_s=publish_s, checkpoint_s=ckpt_s, step_s=time.monotonic() - started,
                      queue_depth=float(queue.depth()), weight_versions_published=float(publisher.num_published))
        values.update({f"staleness_groups/{k}": float(c) for k, c in trainer.totals.staleness_counts.items()})
        metrics.record_step(values, trainer.last_staleness)
        metrics.QUEUE_DEPTH.set(values["queue_depth"])
        metrics.POLICY_VERSION.set(trainer.policy_version)
        report = MetricsReport("trainer", step, trainer.policy_version, time.time(), values)
        client.xadd(keys.metrics("trainer"), {"m": encode(report)}, maxlen=100000, approximate=True)
        logger.info("step %d policy_version=%d reward=%.3f staleness_max=%d loss=%.4f step_s=%.2f", step,
                    trainer.policy_version, values["reward_mean"], values["staleness_max"], values.get("loss", 0.0), values["step_s"])
    done = MetricsReport("trainer", -1, trainer.policy_version, time.time(), {"done": 1.0})
    client.xadd(keys.metrics("trainer"), {"m": encode(done)})
    stop.wait(args.linger_s)  # keep serving the last versions so slow rollout servers can fetch them
    publisher.close()


def _totals(trainer) -> dict[str, float]:
    totals = trainer.totals
    return {"samples_trained": totals.samples_trained, "stale_dropped": totals.stale_dropped,
            "duplicates_skipped": totals.duplicates_skipped, "steps_skipped": totals.steps_skipped}


class ControlReader:
    """Reads the run's control stream (coordinator/control.py writes it): ``sync`` and ``set`` commands.

    Polled between steps and about once a second while a step waits for groups, so an operator's command
    is seen even while the queue is empty (a paused coordinator, an eval round).
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

    def poll(self) -> None:
        entries = self.client.xread({self.keys.control: self.last_id}, count=100) or []
        sync = False
        for _stream, items in entries:
            for entry_id, fields in items:
                self.last_id = entry_id
                command = fields.get(b"c", b"").decode(errors="replace")
                if command == "sync":
                    sync = True
                elif command == "set":
                    self._apply_setting(fields)
        if sync:
            # Same version number: the weights of version v are what the trainer holds (a skipped step
            # changed nothing), and the coordinator counts versions as steps consumed. Servers already on v
            # ignore it; stale ones catch up; the manifest's TTL is renewed.
            logger.info("control: sync -> re-publishing policy_version=%d", self.trainer.policy_version)
            self.publish()

    def _apply_setting(self, fields) -> None:
        key = fields.get(b"key", b"").decode(errors="replace")
        try:
            value = json.loads(fields.get(b"value", b"null"))
            if key == "coordinator.max_staleness":
                self.trainer.max_staleness = int(value)
            elif key == "coordinator.sampling.temperature":
                self.trainer.backend.temperature = float(value)
            else:
                return  # a setting of another role
        except (ValueError, TypeError) as error:  # a malformed command must not stop training
            logger.error("control: ignoring set %s=%r: %s", key, fields.get(b"value"), error)
            return
        logger.info("control: %s set to %r (policy_version=%d)", key, value, self.trainer.policy_version)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer %(levelname)s %(name)s: %(message)s")
    args = parse_args(sys.argv[1:] if argv is None else argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    run(args, stop)


if __name__ == "__main__":
    main()
