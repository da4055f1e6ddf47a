"""``python -m trainer_service train --config run.json --model DIR --redis-url URL``: the trainer role."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time

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


def run(args: argparse.Namespace, stop: threading.Event) -> None:
    import redis
    import torch

    from protos.config import load_run_config
    from protos.records import MetricsReport, encode
    from protos.redis_keys import RedisKeys
    from trainer_service.publisher import WeightPublisher
    from trainer_service.queue import TrajectoryQueue
    from trainer_service.torch_backend import TorchBackend
    from trainer_service.trainer import Trainer

    config = load_run_config(args.config, args.overrides)
    tcfg, ccfg = config.trainer, config.coordinator
    torch.set_num_threads(1)
    client = redis.Redis.from_url(args.redis_url, socket_timeout=30)
    keys = RedisKeys(config.run_id)
    queue = TrajectoryQueue(client, keys)
    queue.reclaim_pending()
    publisher = WeightPublisher(client, keys, config.weight_bus)
    start_version = int(client.get(keys.policy_version) or 0)
    client.setnx(keys.policy_version, start_version)
    backend = TorchBackend(args.model, tcfg, temperature=ccfg.sampling.temperature)
    trainer = Trainer(backend, ccfg.max_staleness, start_version)
    for step in range(1, tcfg.num_steps + 1):
        if stop.is_set():
            break
        started = time.monotonic()
        # 1) pop one step's groups from the queue
        groups = queue.read(ccfg.groups_per_step, timeout_s=tcfg.batch_timeout_s)
        if len(groups) < ccfg.groups_per_step:
            raise TimeoutError(
                f"step {step}: waited {tcfg.batch_timeout_s}s for {ccfg.groups_per_step} groups "
                f"from {keys.trajectories}, got {len(groups)}"
            )
        wait_s = time.monotonic() - started
        # 2) check policy lag and 3) take the optimizer step (inside Trainer.step)
        previous_version = trainer.policy_version
        values = trainer.step([group for _, group in groups])
        # 4) publish weights v+1 if the step was taken, then acknowledge the consumed entries
        publish_s = 0.0
        if trainer.policy_version != previous_version:
            publish_s = publisher.publish(trainer.policy_version, backend.export_hf_weights())
        queue.ack([entry_id for entry_id, _ in groups])
        # 5) log and report
        values.update(wait_s=wait_s, publish_s=publish_s, step_s=time.monotonic() - started,
                      queue_depth=float(queue.depth()), weight_versions_published=float(publisher.num_published))
        report = MetricsReport("trainer", step, trainer.policy_version, time.time(), values)
        client.xadd(keys.metrics("trainer"), {"m": encode(report)}, maxlen=100000, approximate=True)
        logger.info("step %d policy_version=%d reward=%.3f staleness_max=%d loss=%.4f step_s=%.2f", step,
                    trainer.policy_version, values["reward_mean"], values["staleness_max"], values.get("loss", 0.0), values["step_s"])
    done = MetricsReport("trainer", -1, trainer.policy_version, time.time(), {"done": 1.0})
    client.xadd(keys.metrics("trainer"), {"m": encode(done)})
    stop.wait(args.linger_s)  # keep serving the last versions so slow rollout servers can fetch them
    publisher.close()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer %(levelname)s %(name)s: %(message)s")
    args = parse_args(sys.argv[1:] if argv is None else argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    run(args, stop)


if __name__ == "__main__":
    main()
