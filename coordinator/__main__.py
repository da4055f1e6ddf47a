"""``python -m coordinator run --config run.json --servers H:P,H:P``: the coordinator role."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time

logger = logging.getLogger("coordinator")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m coordinator", description=__doc__)
    parser.add_argument("command", choices=["run"])
    parser.add_argument("--config", default=None)
    parser.add_argument("--servers", required=True, help="comma-separated rollout server addresses")
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("overrides", nargs="*")
    return parser.parse_intermixed_args(argv)


async def wait_for_servers(clients, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for client in clients:
        while not await client.check_health():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rollout server {client.address} not healthy after {timeout_s}s")
            await asyncio.sleep(0.5)
        await client.info()


async def report_metrics(scheduler, queue, client, keys, started: float, stop: asyncio.Event) -> None:
    from protos.records import MetricsReport, encode

    last_tokens, last_time = 0, time.monotonic()
    while True:
        try:
            await asyncio.wait_for(stop.wait(), timeout=1.0)
        except TimeoutError:
            pass
        now, stats = time.monotonic(), scheduler.stats
        values = {
            "tokens_per_s": (stats.tokens_generated - last_tokens) / max(1e-6, now - last_time),
            "groups_admitted": stats.groups_admitted,
            "groups_pushed": stats.groups_pushed,
            "samples_pushed": stats.samples_pushed,
            "redispatches": stats.redispatches,
            "queue_depth": await queue.depth(),
            "mean_reward": stats.reward_sum / max(1, stats.samples_pushed),
            "uptime_s": now - started,
        }
        last_tokens, last_time = stats.tokens_generated, now
        report = MetricsReport("coordinator", stats.groups_pushed, scheduler.trainer_version, time.time(), values)
        await client.xadd(keys.metrics("coordinator"), {"m": encode(report)}, maxlen=10000, approximate=True)
        if stop.is_set():  # one last report after the stop so the totals are final
            return


async def run(args: argparse.Namespace) -> None:
    import redis.asyncio as aioredis

    from coordinator.dashboard import start_dashboard
    from coordinator.fleet import FleetWatcher
    from coordinator.queue_writer import RolloutQueue
    from coordinator.rollout_client import RolloutClient
    from coordinator.scheduler import Scheduler
    from coordinator.tasks import EchoTask
    from protos.config import load_run_config
    from protos.redis_keys import RedisKeys

    config = load_run_config(args.config, args.overrides)
    cfg = config.coordinator
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    started = time.monotonic()

    # 1) connect Redis and the rollout servers; wait until every server is healthy
    client = aioredis.Redis.from_url(args.redis_url, socket_timeout=30)
    keys = RedisKeys(config.run_id)
    dashboard = None
    if cfg.dashboard:  # up before the servers are, so the page shows the fleet starting
        dashboard, dashboard_port = await start_dashboard(client, keys, cfg.dashboard_host, cfg.dashboard_port)
        logger.info("dashboard on http://%s:%d/", cfg.dashboard_host, dashboard_port)
    clients = [RolloutClient(address) for address in args.servers.split(",") if address]
    await wait_for_servers(clients, timeout_s=300)
    queue = RolloutQueue(client, keys)
    task = EchoTask(seed=cfg.seed, max_tokens=cfg.sampling.max_tokens)
    total_groups = config.trainer.num_steps * cfg.groups_per_step
    scheduler = Scheduler(cfg, clients, queue, task, total_groups)
    # 2) background tasks: fleet/version watcher and metrics reports (supervised below)
    watcher = FleetWatcher(scheduler, client, keys)
    background = [
        asyncio.create_task(watcher.run(stop), name="fleet-watcher"),
        asyncio.create_task(report_metrics(scheduler, queue, client, keys, started, stop), name="metrics"),
    ]
    producers: set[asyncio.Task] = set()
    # 3) admit prompts while the staleness bound allows; each admitted group is produced concurrently
    while not stop.is_set() and scheduler.stats.groups_pushed < total_groups:
        _raise_if_failed(background + list(producers))
        producers = {t for t in producers if not t.done()}
        if scheduler.can_admit():
            index, prompt = scheduler.admit()
            task_ = asyncio.create_task(scheduler.produce_group(index, prompt, scheduler.trainer_version))
            producers.add(task_)
            continue
        await asyncio.sleep(0.05)
    # 4) finish: wait for in-flight groups, stop background tasks, say how much was produced
    logger.info("coordinator done: %s", scheduler.stats)
    stop.set()
    await asyncio.gather(*producers, *background, return_exceptions=True)
    for rollout_client in clients:
        await rollout_client.close()
    if dashboard is not None:
        await dashboard.cleanup()
    await client.aclose()


def _raise_if_failed(tasks: list[asyncio.Task]) -> None:
    """Supervision: a background or producer task that died takes the coordinator down with its error."""
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s coordinator %(levelname)s %(name)s: %(message)s")
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import uvloop

    uvloop.run(run(args))


if __name__ == "__main__":
    main()
