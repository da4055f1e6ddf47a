"""``python -m coordinator run --config run.json [--servers H:P,H:P]``: the coordinator role."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

from coordinator.restart import remaining_groups, resume_prompts, startup_read

logger = logging.getLogger("coordinator")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m coordinator", description=__doc__)
    parser.add_argument("command", choices=["run"])
    parser.add_argument("--config", default=None)
    parser.add_argument(
        "--servers",
        default="",
        help="comma-separated rollout server addresses; with coordinator.discovery the servers that register in "
        "Redis join as well (then none need be listed)",
    )
    parser.add_argument("--redis-url", default=None, help="alias of the config key redis_url")
    parser.add_argument(
        "--model", default=None, help="alias of the config key model_path (its tokenizer renders dataset prompts)"
    )
    parser.add_argument(
        "--linger-s",
        type=float,
        default=0.0,
        help="keep /metrics and the admin API up this long after the last group (for a last Prometheus scrape)",
    )
    parser.add_argument("overrides", nargs="*")
    return parser.parse_intermixed_args(argv)


@dataclass
class Pipeline:
    """``PromptSource -> RolloutClient -> RewardFn -> TrajectoryStreamWriter`` and the eval runner, from the config."""

    scheduler: object  # coordinator.scheduler.Scheduler
    evals: object | None  # coordinator.evaluation.EvalRunner
    executor: ThreadPoolExecutor


async def build_pipeline(config, client, keys, fleet) -> Pipeline:
    from channels.trajectory_stream import TrajectoryStreamWriter
    from channels.version_board import AsyncVersionBoard
    from coordinator.evaluation import EvalRunner, eval_versions, load_eval_sets
    from coordinator.metrics import reported_eval_versions
    from coordinator.rewards import get_reward_fn
    from coordinator.scheduler import Scheduler
    from coordinator.tasks import PromptRenderer, ResponseScorer, build_task, load_tokenizer
    from protos.config.coordinator import BUILT_IN_TASKS

    cfg = config.coordinator
    if cfg.sampling.top_p < 1.0 or cfg.sampling.top_k > 0:
        logger.warning(
            "coordinator.sampling top_p=%s top_k=%s: rollout logprobs are of the truncated distribution, "
            "which the trainer does not model, so off-policy ratios are biased (train with top_p=1, "
            "top_k=-1)",
            cfg.sampling.top_p,
            cfg.sampling.top_k,
        )
    needs_tokenizer = cfg.task not in BUILT_IN_TASKS or bool(cfg.eval.datasets)
    tokenizer = load_tokenizer(config.model_path) if needs_tokenizer else None
    executor = ThreadPoolExecutor(cfg.reward_threads, thread_name_prefix="reward")
    task = build_task(cfg, config.rollout.max_model_len, tokenizer, executor)
    board = AsyncVersionBoard(client, keys)
    start_version, version_offset = await startup_read(board.version_and_offset, "the trainer's version and offset")
    queue = TrajectoryStreamWriter(client, keys)
    # version - offset = the steps the trainer has taken (RedisKeys.version_offset)
    pushed = await startup_read(queue.pushed_total, "the groups pushed so far")
    steps_done = max(0, start_version - version_offset)
    total_groups, queued = remaining_groups(config, pushed, steps_done)
    if pushed:
        await resume_prompts(task, queue)
    scheduler = Scheduler(config, fleet, queue, task, total_groups, start_version, version_offset, queued, pushed)
    evals = None
    if cfg.eval.datasets:
        renderer = PromptRenderer(tokenizer, cfg.template_kwargs())
        sets = load_eval_sets(cfg, renderer, config.rollout.max_model_len)
        scorer = ResponseScorer(tokenizer, get_reward_fn(cfg.eval.reward_fn), executor, cfg.reward_timeout_s)
        evals = EvalRunner(config, fleet, sets, scorer, str(config.export_path()))
        evaluated = (
            await startup_read(partial(reported_eval_versions, client, keys), "eval rounds") if pushed else set()
        )
        evals.schedule(eval_versions(cfg.eval, start_version, config.num_steps, steps_done, evaluated))
    logger.info(
        "coordinator: task %s, %d groups of %d, start at trainer v%d, eval at %s",
        cfg.task,
        total_groups,
        cfg.group_size,
        start_version,
        evals.pending if evals else [],
    )
    return Pipeline(scheduler, evals, executor)


def follow_version_offset(pipeline: Pipeline, total: int) -> None:
    """The trainer's version - steps changed (a restart, a step that published nothing): shift the slot arithmetic
    and the eval schedule alike."""
    shift = pipeline.scheduler.set_version_offset(total)
    if shift and pipeline.evals is not None:
        pipeline.evals.shift(shift)


async def eval_round(evals, reporter, version: int) -> None:
    from channels.retry import UNREACHABLE

    values = await evals.run_round(version)
    if values is None:
        return
    try:
        await reporter.report_eval(version, values)
    except UNREACHABLE as error:  # an XADD, not retried (not idempotent); the round's figures are logged anyway
        logger.warning("eval report of v%d to Redis failed: %s", version, error)


@dataclass
class Operators:
    """What serves operators and watches the fleet: stopped at the end of the run."""

    reporter: object  # coordinator.metrics.MetricsReporter
    admin: object  # grpc.aio.Server
    runners: list  # aiohttp runners (dashboard, /metrics)
    background: list[asyncio.Task]


async def start_operators(
    config, pipeline: Pipeline, client, keys, fleet, runners: list, stop, discovery=None
) -> Operators:
    from coordinator.admin import AdminCore, start_admin_server
    from coordinator.control import ControlChannel
    from coordinator.fleet import FleetWatcher
    from coordinator.metrics import MetricsReporter, start_metrics_server

    cfg, scheduler = config.coordinator, pipeline.scheduler
    reporter = MetricsReporter(scheduler, pipeline.evals, scheduler.queue, client, keys)
    core = AdminCore(config, scheduler, reporter, ControlChannel(client, keys), pipeline.evals, discovery)
    admin, admin_port = await start_admin_server(core, cfg.admin_host, cfg.admin_port)
    logger.info(
        "admin API on %s:%d (fleetrl status --admin %s:%d)", cfg.admin_host, admin_port, cfg.admin_host, admin_port
    )
    if cfg.metrics_port:
        metrics_runner, metrics_port = await start_metrics_server(reporter, cfg.admin_host, cfg.metrics_port)
        runners.append(metrics_runner)
        logger.info("Prometheus metrics on http://%s:%d/metrics", cfg.admin_host, metrics_port)
    background = [
        asyncio.create_task(
            FleetWatcher(
                fleet,
                scheduler.set_trainer_version,
                client,
                keys,
                on_version_offset=partial(follow_version_offset, pipeline),
                discovery=discovery,
            ).run(stop),
            name="fleet",
        ),
        asyncio.create_task(reporter.run(stop), name="metrics"),
    ]
    return Operators(reporter, admin, runners, background)


@dataclass
class AgentDoor:
    """The agent API (coordinator/agents/api.py) and its expiry loop: stopped at the end of the run."""

    book: object  # coordinator.agents.sessions.SessionBook
    server: object  # grpc.aio.Server
    port: int
    expiry: asyncio.Task
    openai_door: object = None  # aiohttp AppRunner of the OpenAI-compatible door, when agent.openai_port >= 0


async def start_agent_door(config, pipeline: Pipeline, fleet, stop: asyncio.Event, operators: Operators) -> AgentDoor:
    """The agent API (and the OpenAI door when configured) over the sessions an earlier coordinator of the run left
    in Redis (restored before it serves and before any admission); its expiry loop is supervised with the
    operators'."""
    from channels.agent_sessions import AgentSessionStore
    from coordinator.agents.api import agent_authenticator
    from coordinator.agents.restore import restore_book
    from coordinator.agents.sessions import SessionBook
    from coordinator.kept_port import start_agent_server_of_run

    scheduler = pipeline.scheduler
    _, info = await fleet.served_info()
    book = SessionBook(
        config.agent,
        scheduler,
        fleet,
        lambda: scheduler.run.temperature,  # live: the admin API may change it
        info.max_model_len,
        info.vocab_size,
        AgentSessionStore(scheduler.queue.client, scheduler.queue.keys),  # the run's Redis and key names
    )
    cursor = await scheduler.queue.prompt_cursor()  # names the last group pushed
    await restore_book(book, cursor.group_id if cursor is not None else None)
    auth = agent_authenticator(config.agent)
    server, port = await start_agent_server_of_run(  # a picked port is the run's: kept across restarts
        book, auth, config.agent, scheduler.queue.client, scheduler.queue.keys
    )
    logger.info("agent API on %s:%d (only agents: %s)", config.agent.host, port, config.agent.only_agents)
    door = None
    if config.agent.openai_port >= 0:
        from coordinator.agents.api import http_authorize
        from coordinator.kept_port import start_openai_door_of_run
        from coordinator.tasks import load_tokenizer

        tokenizer = load_tokenizer(config.model_path)
        door, door_port = await start_openai_door_of_run(  # a picked port is the run's: kept across restarts
            book,
            tokenizer,
            http_authorize(auth),
            config.agent.host,
            config.agent.openai_port,
            scheduler.queue.client,
            scheduler.queue.keys,
        )
        logger.info("OpenAI-compatible door on http://%s:%d/v1", config.agent.host, door_port)

    async def expire_sessions() -> None:
        while not stop.is_set():
            await book.expire()
            try:
                await asyncio.wait_for(stop.wait(), timeout=1.0)
            except TimeoutError:
                pass

    expiry = asyncio.create_task(expire_sessions(), name="agent-expiry")
    operators.background.append(expiry)
    return AgentDoor(book, server, port, expiry, door)


async def run(args: argparse.Namespace) -> None:
    import redis.asyncio as aioredis

    from coordinator.dashboard import start_dashboard
    from coordinator.discovery import connect_fleet, served_max_model_len
    from protos.config import flag_overrides, load_run_config
    from protos.redis_keys import RedisKeys

    config = load_run_config(
        args.config, [*flag_overrides({"model_path": args.model, "redis_url": args.redis_url}), *args.overrides]
    ).with_dataset_paths()
    if not config.redis_url:
        raise SystemExit("coordinator: redis_url must be set (the config key, or --redis-url)")
    cfg = config.coordinator
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    logger.info("resolved config: %s", config.model_dump_json())

    # 1) connect Redis and the rollout servers; wait until every server is healthy
    client = aioredis.Redis.from_url(config.redis_url, socket_timeout=30)
    keys = RedisKeys(config.run_id)
    runners: list = []
    if cfg.dashboard:  # up before the servers are, so the page shows the fleet starting
        runners.append((await start_dashboard(client, keys, cfg.dashboard_host, cfg.dashboard_port))[0])
    fleet, discovery = await connect_fleet(args.servers, cfg, client, keys)
    if config.rollout.max_model_len is None:  # this machine cannot read the checkpoint: the servers say what they serve
        config.rollout.max_model_len = await served_max_model_len(fleet, cfg.sampling.max_tokens)
    # 2) build the pipeline: task (prompts and rewards), eval sets, the scheduler core
    pipeline = await build_pipeline(config, client, keys, fleet)
    scheduler, evals = pipeline.scheduler, pipeline.evals
    # 3) serve operators and watch the fleet: admin API, /metrics, metrics reports (supervised below)
    operators = await start_operators(config, pipeline, client, keys, fleet, runners, stop, discovery)
    agents = await start_agent_door(config, pipeline, fleet, stop, operators) if config.agent.enabled else None
    # What startup built (modules, the fleet's clients, configs) lives for the whole run: frozen, it is left out of
    # the collector's full passes, which otherwise stalled the loop for 0.1-0.5 s at a time (benchmarks/fleet_scale.py).
    gc.freeze()
    producers: set[asyncio.Task] = set()
    eval_task: asyncio.Task | None = None
    # 4) loop: supervise; start a due eval round; admit while the staleness bound (and eval hold) allows
    while not stop.is_set() and not _finished(scheduler, evals, eval_task):
        _raise_if_failed([*operators.background, *producers, *([eval_task] if eval_task else [])])
        producers = {t for t in producers if not t.done()}
        scheduler.update_state()
        if evals is not None and (eval_task is None or eval_task.done()):
            version = evals.due(scheduler)
            if version is not None:
                eval_task = asyncio.create_task(eval_round(evals, operators.reporter, version), name=f"eval-v{version}")
        if scheduler.can_admit() and not config.agent.only_agents:
            slot, prompt = scheduler.admit()
            producers.add(asyncio.create_task(scheduler.produce_group(slot, prompt), name=f"group-{slot}"))
            continue
        await asyncio.sleep(0.05)
    # 5) finish: say how much was produced, stop everything, report once more, close servers and clients
    logger.info("coordinator %s: %s", scheduler.state.name.lower(), scheduler.stats)
    await _linger_then_stop(stop, args.linger_s)
    if agents is not None:
        await agents.server.stop(grace=0.5)
        if agents.openai_door is not None:
            await agents.openai_door.cleanup()
    await shutdown([*producers, *([eval_task] if eval_task else [])], operators, pipeline, fleet)
    await client.aclose()


async def shutdown(unfinished: list[asyncio.Task], operators: Operators, pipeline: Pipeline, fleet) -> None:
    from coordinator.scheduler import RunState

    for task in unfinished:
        task.cancel()  # only left when a signal stops the run
    await asyncio.gather(*unfinished, *operators.background, return_exceptions=True)
    drained = pipeline.scheduler.state == RunState.DRAINED
    await operators.admin.stop(grace=2.0 if drained else 0.5)  # a drain's reply must get out
    for runner in operators.runners:
        await runner.cleanup()
    await fleet.close()
    pipeline.executor.shutdown(wait=False, cancel_futures=True)


async def _linger_then_stop(stop: asyncio.Event, linger_s: float) -> None:
    """Keep /metrics and the admin API up ``linger_s`` more seconds (the final counters stay scrapable; a stop
    signal ends the wait early), then set ``stop``."""
    if linger_s > 0 and not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=linger_s)
        except TimeoutError:
            pass
    stop.set()


def _finished(scheduler, evals, eval_task) -> bool:
    """Drained, or every group pushed with no eval round left to run."""
    from coordinator.scheduler import RunState

    if scheduler.state == RunState.DRAINED:
        return True
    evals_left = evals is not None and (evals.pending or (eval_task is not None and not eval_task.done()))
    return scheduler.state == RunState.FINISHED and not evals_left


def _raise_if_failed(tasks: list[asyncio.Task]) -> None:
    """Supervision: a background or producer task that died takes the coordinator down with its error."""
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s coordinator %(levelname)s %(name)s: %(message)s")
    # math_verify warns on every call made off the main thread that its signal-based timeout is off;
    # rewards run in threads by design, with score_group's timeout and input caps as the guard.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import uvloop

    uvloop.run(run(args))


if __name__ == "__main__":
    main()
