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
    return parser.parse_args(argv)


def staleness_filter(groups, policy_version: int, max_staleness: int):
    """Split (entry id, group) pairs into those within the bound and the stale ones."""
    fresh, stale = [], []
    for entry_id, group in groups:
        oldest = min(sample.min_version for sample in group.samples)
        (fresh if policy_version - oldest <= max_staleness else stale).append((entry_id, group))
    return fresh, stale


def run(args: argparse.Namespace, stop: threading.Event) -> None:
    import redis
    import torch

    from protos.config import load_run_config
    from protos.records import MetricsReport, encode
    from protos.redis_keys import RedisKeys
    from trainer_service.batch import build_batch
    from trainer_service.publisher import WeightPublisher
    from trainer_service.queue import TrajectoryQueue
    from trainer_service.torch_backend import TorchBackend

    config = load_run_config(args.config, args.overrides)
    tcfg, ccfg = config.trainer, config.coordinator
    torch.set_num_threads(1)
    client = redis.Redis.from_url(args.redis_url, socket_timeout=30)
    keys = RedisKeys(config.run_id)
    queue = TrajectoryQueue(client, keys)
    queue.reclaim_pending()
    backend = TorchBackend(args.model, tcfg, temperature=ccfg.sampling.temperature)
    publisher = WeightPublisher(client, keys, config.weight_bus)
    policy_version = int(client.get(keys.policy_version) or 0)
    client.setnx(keys.policy_version, policy_version)
    totals = {"samples_trained": 0, "stale_dropped": 0, "max_staleness_seen": 0}
    for step in range(tcfg.num_steps):
        if stop.is_set():
            break
        started = time.monotonic()
        # 1) pop one step's groups from the queue
        groups = queue.read(ccfg.groups_per_step, timeout_s=tcfg.batch_timeout_s)
        if len(groups) < ccfg.groups_per_step:
            raise TimeoutError(
                f"step {step}: waited {tcfg.batch_timeout_s}s for {ccfg.groups_per_step} groups from "
                f"{keys.trajectories}, got {len(groups)}"
            )
        wait_s = time.monotonic() - started
        # 2) check policy lag: samples beyond the staleness bound are dropped and counted
        fresh, stale = staleness_filter(groups, policy_version, ccfg.max_staleness)
        staleness = [policy_version - min(s.min_version for s in g.samples) for _, g in groups]
        totals["stale_dropped"] += sum(len(g.samples) for _, g in stale)
        totals["max_staleness_seen"] = max(totals["max_staleness_seen"], max(staleness))
        # 3) loss and optimizer step
        metrics = {"skipped": 1.0}
        batch = None
        if fresh:
            batch = build_batch([g for _, g in fresh])
            metrics = backend.train_step(batch)
        # 4) publish weights v+1 (not after a skipped step), then acknowledge the consumed entries
        publish_s = 0.0
        if not metrics["skipped"]:
            policy_version += 1
            publish_s = publisher.publish(policy_version, backend.export_hf_weights())
        queue.ack([entry_id for entry_id, _ in groups])
        totals["samples_trained"] += 0 if batch is None else int(batch.rewards_B.numel())
        # 5) log and report
        values = {
            **metrics,
            "reward_mean": float(batch.rewards_B.mean()) if batch is not None else 0.0,
            "staleness_max": float(max(staleness)),
            "staleness_mean": sum(staleness) / len(staleness),
            "wait_s": wait_s,
            "step_s": time.monotonic() - started,
            "publish_s": publish_s,
            "queue_depth": float(queue.depth()),
            "weight_versions_published": float(publisher.num_published),
            **{k: float(v) for k, v in totals.items()},
        }
        report = MetricsReport("trainer", step + 1, policy_version, time.time(), values)
        client.xadd(keys.metrics("trainer"), {"m": encode(report)}, maxlen=100000, approximate=True)
        logger.info(
            "step %d policy_version=%d reward=%.3f staleness_max=%d loss=%.4f step_s=%.2f",
            step + 1, policy_version, values["reward_mean"], max(staleness), metrics.get("loss", 0.0), values["step_s"],
        )
    client.xadd(keys.metrics("trainer"), {"m": encode(MetricsReport("trainer", -1, policy_version, time.time(), {"done": 1.0}))})
    # Keep serving the last versions so slow rollout servers can still fetch them.
    stop.wait(args.linger_s)
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
