"""DemoLauncher: starts every role of a run as its own OS process, shows progress, writes summary.json.

It only starts and supervises: the roles talk through Redis, gRPC and the weight bus. The processes come from the
specs both launchers build (launcher/roles.py) and run under ``SupervisedProcess`` (launcher/supervision.py):
each in its own process group, so that a stop (or Ctrl-C) takes down the vLLM engine processes too (and a multi-rank
trainer's ranks: ``trainer.num_processes`` > 1 starts it under torchrun, see ``trainer_command``), and each restarted
after a failure by ``launcher.restart``. A restarted rollout server registers at its new address and the coordinator
discovers it; the trainer resumes from its checkpoint, the coordinator from its prompt cursor. The summary counts the
restarts per role. ``fleetrl up`` (launcher/ray_launcher.py) runs the same roles on Ray.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import redis

from channels.metrics_stream import MetricsStreamReader
from channels.retry import UNREACHABLE, retry_sync
from channels.version_board import VersionBoard
from launcher import roles
from launcher.demo_agents import demo_agent_commands, prepare_agents
from launcher.redis_server import free_port, redis_spec, wait_accepting
from launcher.roles import RoleSpec
from launcher.run_figures import replay_figures, speed_figures
from launcher.run_logger import RunLogger, append_step, read_reports
from launcher.supervision import RoleFailed, SupervisedProcess, log_tail, write_roles
from launcher.tiny_models import tiny_model_dir
from protos.config import RunConfig
from protos.records import RoleDone
from protos.redis_keys import RedisKeys
from protos.trainer_command import trainer_argv

logger = logging.getLogger(__name__)


def trainer_command(config: RunConfig, role_args: Sequence[str] = ()) -> list[str]:
    """The trainer's module invocation (``protos.trainer_command``): one process, or ``trainer.num_processes``
    ranks under torchrun; ``role_args`` follow ``train``."""
    tcfg = config.trainer
    if tcfg.num_nodes > 1:
        raise ValueError(
            f"trainer.num_nodes={tcfg.num_nodes}: this launcher starts one node; launch multi-node trainers with "
            "deploy/ (torchrun on every node), or set trainer.num_nodes=1"
        )
    return trainer_argv(config, role_args)


def check_gpu_layout(config: RunConfig, num_gpus: int) -> None:
    """Refuse, before any process starts, a weight transport this machine's GPUs cannot carry.

    ``nccl`` broadcasts from the trainer's GPU to every rollout GPU, one rank per GPU: on one machine it needs a
    GPU for each trainer rank and each rollout rank. ``ipc`` needs the trainer and the engine on one GPU.
    """
    transport = config.weight_bus.transport
    rollout = config.rollout
    rollout_gpus = rollout.num_servers * rollout.tensor_parallel_size * rollout.pipeline_parallel_size
    trainer_gpus = config.trainer.num_processes
    if transport == "nccl" and num_gpus < trainer_gpus + rollout_gpus:
        raise ValueError(
            f"weight_bus.transport='nccl' needs one GPU per rank: {trainer_gpus} trainer + {rollout_gpus} rollout "
            f"GPUs, this machine has {num_gpus}. On one GPU use weight_bus.transport='ipc' (trainer and engine "
            "share it) or 'tcp'; the nccl broadcast runs on multi-GPU machines (deploy/)"
        )


class DemoLauncher:
    """The roles on this machine, each a ``SupervisedProcess`` (restarted by ``launcher.restart``)."""

    def __init__(self, config: RunConfig, out_dir: Path):
        self.config = config
        self.out_dir = out_dir
        if not config.out_dir:  # eval samples, exports and trainer checkpoints go under the run directory
            config.out_dir = str(out_dir)
        self.log_dir = config.log_path()
        self.keys = RedisKeys(config.run_id)
        self.roles: dict[str, SupervisedProcess] = {}
        self.posted_reports: dict[str, dict] = {}  # what roles.json holds
        self.started = time.monotonic()
        self.rollout_rates: list[float] = []  # the coordinator's tokens/s reports (summary median)
        # (server, version) -> that update's (update_s, paused_s), as the servers' reports showed them per step
        self.weight_updates: dict[tuple[str, int], tuple[float, float]] = {}
        self.redis_down_since: float | None = None  # monotonic time the monitor lost Redis (None: it reaches it)

    # process management --------------------------------------------------------------------
    def spawn(self, make_spec: Callable[[], RoleSpec]) -> None:
        role = SupervisedProcess(make_spec, self.log_dir, self.config.launcher.restart)
        self.roles[role.name] = role
        role.start()

    def check_children(self) -> None:
        """Supervise every role: a failed one is restarted by the policy (said on stdout); ``RoleFailed`` once the
        policy gives up on one."""
        for role in self.roles.values():
            event = role.supervise()
            if event:
                print(f"fleetrl: {event}", flush=True)
        reports = {name: role.report() for name, role in self.roles.items()}
        if reports != self.posted_reports:
            write_roles(self.out_dir, reports)
            self.posted_reports = reports

    def coordinator_running(self) -> bool:
        coordinator = self.roles["coordinator"]
        return not coordinator.finished and not coordinator.failed

    def restarts(self) -> dict[str, int]:
        return {name: role.restarts for name, role in self.roles.items()}

    def stop_all(self, grace_s: float = 10.0) -> None:
        """Every role, the embedded Redis last (the others may still write on their way out)."""
        last = [role for role in self.roles.values() if role.spec.kind == roles.REDIS]
        for group in ([role for role in self.roles.values() if role not in last], last):
            for role in group:
                role.terminate()
            deadline = time.monotonic() + grace_s
            for role in group:
                role.wait_stopped(deadline)

    # the run -------------------------------------------------------------------------------
    def prepare(self, redis_url: str) -> Path:
        """Fill in what every role must share (model, Redis, run directory), write it as the run's config.json and
        return its path: the one source of settings of every role process."""
        self.config.model_path = self.config.model_path or str(tiny_model_dir(self.config.tiny_model))
        self.config.redis_url = redis_url
        self.agent_token = prepare_agents(self.config, self.out_dir) if self.config.agent.enabled else ""
        config_path = self.out_dir / "config.json"
        config_path.write_text(self.config.model_dump_json(indent=2))
        return config_path

    def start(self) -> str:
        trainer_command(self.config)  # refuses a layout this launcher cannot start, before any child
        check_gpu_layout(self.config, _num_gpus())
        self.log_dir.mkdir(parents=True, exist_ok=True)
        redis_url = self.config.redis_url or os.environ.get("REDIS_URL", "")
        if not redis_url:
            redis_url = self.start_redis()
        config_path = self.prepare(redis_url)
        rollouts = [
            partial(roles.rollout_spec, self.config, config_path, self.out_dir, i)
            for i in range(self.config.rollout.num_servers)
        ]
        for make_spec in rollouts:
            self.spawn(make_spec)
        self.spawn(partial(roles.trainer_spec, self.config, config_path))
        addresses = self.wait_for_addresses({make().name: Path(make().address_file) for make in rollouts})
        self.spawn(lambda: roles.coordinator_spec(self.config, config_path, self.current_addresses() or addresses))
        self.spawn_demo_agents(self.agent_token)
        return redis_url

    def start_redis(self, timeout_s: float = 30.0) -> str:
        """The embedded valkey as a supervised role with its AOF in <run dir>/valkey (launcher/redis_server.py):
        restarted on the same address after a crash, it comes back with the run's queue. Returns its URL."""
        host = "127.0.0.1"
        port = free_port(host)
        spec = redis_spec(self.out_dir / "valkey", host, port)
        self.spawn(lambda: spec)  # the same spec at every restart: the same port and data directory
        role = self.roles[spec.name]
        try:
            wait_accepting(host, port, timeout_s, lambda: None if role.running else role.process.returncode)
        except (RuntimeError, TimeoutError) as error:
            raise RoleFailed(
                f"the embedded Redis did not start: {error}; its log:\n{log_tail(role.log_path)}"
            ) from None
        return f"redis://{host}:{port}/0"

    def current_addresses(self) -> list[str]:
        """The rollout servers serving now (a restarted coordinator without discovery gets these)."""
        found = [roles.read_address(role.spec) for role in self.roles.values() if role.spec.kind == roles.ROLLOUT]
        return [address for address in found if address]

    def spawn_demo_agents(self, token: str) -> None:
        """``agent.demo_agents`` example agents, once the coordinator's agent API listens."""
        commands = demo_agent_commands(self.config, token)
        if commands:
            self.wait_for_port(self.config.agent.host, self.config.agent.port, "the coordinator's agent API")
        for name, args, env in commands:
            self.spawn(partial(RoleSpec, name, roles.AGENT, tuple(args), env))

    def wait_for_port(self, host: str, port: int, what: str, timeout_s: float = 300.0) -> None:
        """Until ``host:port`` accepts connections (its role keeps running meanwhile)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                socket.create_connection((host, port), timeout=1.0).close()
                return
            except OSError:
                self.check_children()
                if time.monotonic() > deadline:
                    raise RoleFailed(f"{what} not listening on {host}:{port} within {timeout_s:.0f}s") from None
                time.sleep(0.2)

    def wait_for_addresses(self, address_files: dict[str, Path], timeout_s: float = 900.0) -> list[str]:
        """The rollout servers' host:port, once each is serving (engine start takes ~30 s each on CPU)."""
        deadline = time.monotonic() + timeout_s
        while not all(path.exists() for path in address_files.values()):
            self.check_children()
            if time.monotonic() > deadline:
                missing = [name for name, path in address_files.items() if not path.exists()]
                raise RoleFailed(f"{missing} not serving within {timeout_s:.0f}s (their logs are in {self.log_dir})")
            time.sleep(0.2)
        return [path.read_text().strip() for path in address_files.values()]

    def monitor(self, redis_url: str) -> dict:
        """Print a line per training step until the trainer reports done (and hand every report to the run
        logger); returns the summary."""
        client = redis.Redis.from_url(redis_url, socket_timeout=30)
        metrics = MetricsStreamReader(client, self.keys)
        run_logger = RunLogger(self.config)
        trainer_steps: list[dict] = []
        coordinator_last: dict = {}
        cursors = {"trainer": "0", "coordinator": "0"}
        done = False
        try:
            while not done:
                self.check_children()
                for report in self.next_reports(metrics, cursors):
                    if isinstance(report, RoleDone):  # the trainer finished
                        done = done or report.role == "trainer"
                    elif report.role == "coordinator":  # periodic figures, and eval rounds (eval/...)
                        coordinator_last = {**coordinator_last, **report.values}
                        self.rollout_rates.append(report.values.get("tokens_per_s", 0.0))
                        run_logger.log_coordinator(report)
                    elif append_step(trainer_steps, report):
                        self.print_step(trainer_steps[-1], coordinator_last, client)
                        run_logger.log_step(
                            report.step, report.policy_version, report.values, coordinator_last.get("tokens_per_s", 0.0)
                        )
            self.wait_for_fleet(client, trainer_steps[-1]["policy_version"] if trainer_steps else 0)
            coordinator_last.update(self.wait_for_coordinator(metrics, cursors["coordinator"], run_logger))
        finally:
            run_logger.finish()
        return self.summary(client, trainer_steps, coordinator_last)

    def next_reports(self, metrics: MetricsStreamReader, cursors: dict[str, str]) -> list:
        """The reports after ``cursors`` (waiting up to a second); none while Redis is unreachable: the roles ride an
        outage out on their own, so the launcher only says so and keeps supervising (channels/retry.py, periodic)."""
        try:
            reports = read_reports(metrics, cursors, block_s=1.0)
        except UNREACHABLE as error:
            if self.redis_down_since is None:
                self.redis_down_since = time.monotonic()
                print(f"fleetrl: Redis unreachable, waiting for it ({error})", flush=True)
            time.sleep(0.5)
            return []
        if self.redis_down_since is not None:
            print(f"fleetrl: Redis back after {time.monotonic() - self.redis_down_since:.1f}s", flush=True)
            self.redis_down_since = None
        return reports

    def wait_for_coordinator(
        self, metrics: MetricsStreamReader, cursor: str, run_logger: RunLogger, timeout_s: float = 120.0
    ) -> dict:
        """The coordinator exits after its last eval round; returns the figures it reported meanwhile (its eval
        rounds also go to the run logger)."""
        values: dict = {}
        deadline = time.monotonic() + timeout_s
        while self.coordinator_running() and time.monotonic() < deadline:
            self.check_children()
            time.sleep(0.2)
        if self.coordinator_running():
            logger.warning("the coordinator did not exit within %.0fs after the trainer finished", timeout_s)
        self.check_children()
        try:  # an idempotent read: retried through an outage for a while, then the summary goes without
            entries = retry_sync(lambda: metrics.after("coordinator", cursor), "the coordinator's last reports", 30.0)
        except UNREACHABLE as error:
            logger.warning("the coordinator's last reports not read, Redis unreachable: %s", error)
            entries = []
        for entry in entries:
            if entry.report is not None:
                values.update(entry.report.values)
                run_logger.log_coordinator(entry.report)
        return values

    def print_step(self, step: dict, coordinator: dict, client: redis.Redis) -> None:
        versions = self.fleet_versions(client)
        print(
            f"step {step['step']:>3}/{self.config.num_steps} | policy v{step['policy_version']:<3} "
            f"| reward {step['reward_mean']:.3f} | staleness max {step['staleness_max']:.0f} "
            f"(bound {self.config.max_staleness}) | rollout {coordinator.get('tokens_per_s', 0):7.0f} tok/s "
            f"| masked {step.get('geo_mask_masked_ratio', 0):.2f} |dlogp| {step.get('mean_abs_logprob_diff', 0):.3f} "
            f"| queue {step['queue_depth']:.0f} | servers at {versions}{replay_figures(step)} "
            f"| {time.monotonic() - self.started:5.0f}s",
            flush=True,
        )

    def speed_summary(self, client: redis.Redis, steps: list[dict]) -> dict:
        self.fleet_versions(client)  # the last updates too
        return speed_figures(steps, self.rollout_rates, self.weight_updates)

    def fleet_reports(self, client: redis.Redis) -> dict:
        """The rollout servers' version reports; none while Redis is unreachable (a step line, a summary figure)."""
        try:
            return VersionBoard(client, self.keys).fleet_reports()
        except UNREACHABLE as error:
            logger.warning("rollout servers' versions not read, Redis unreachable: %s", error)
            return {}

    def fleet_versions(self, client: redis.Redis) -> dict[str, int]:
        """Each server's version; its last update's durations are kept for the summary's medians."""
        reports = self.fleet_reports(client)
        for server, report in reports.items():
            if report.update_s > 0:
                self.weight_updates[(server, report.policy_version)] = (report.update_s, report.paused_s)
        return {server: report.policy_version for server, report in reports.items()}

    def wait_for_fleet(self, client: redis.Redis, version: int, timeout_s: float = 30.0) -> None:
        """Until every rollout server that beats (a report younger than ``coordinator.server_timeout_s``) is on
        ``version``: a dead server's last report, or a replacement still starting its engine, holds nothing up.
        Roles are supervised meanwhile."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_children()
            beating = [r.policy_version for r in self.fleet_reports(client).values() if self.beats(r)]
            if beating and min(beating) >= version:
                return
            time.sleep(0.2)
        logger.warning(
            "not every rollout server reached v%d within %.0fs: %s", version, timeout_s, self.fleet_versions(client)
        )

    def beats(self, report) -> bool:
        return time.time() - report.time_s <= self.config.coordinator.server_timeout_s

    def summary(self, client: redis.Redis, steps: list[dict], coordinator: dict) -> dict:
        rewards = [s["reward_mean"] for s in steps]
        last = steps[-1] if steps else {}
        versions = self.fleet_versions(client)
        skipped = sum(1 for s in steps if s.get("skipped"))
        return {
            "steps": len(steps) - skipped,  # optimizer steps taken: one that trained nothing is not a step
            "steps_skipped": skipped,
            "reward_first5": sum(rewards[:5]) / max(1, len(rewards[:5])),
            "reward_last5": sum(rewards[-5:]) / max(1, len(rewards[-5:])),
            "max_staleness_allowed": self.config.max_staleness,
            "max_staleness_seen": int(max((s["staleness_max"] for s in steps), default=0)),
            "weight_versions_published": int(last.get("weight_versions_published", 0)),
            "rollout_servers": len(versions),
            "rollout_server_versions": versions,
            "trajectories_produced": int(coordinator.get("samples_pushed", 0)),
            "trajectories_trained": int(last.get("samples_trained", 0)),
            "stale_samples_dropped": int(last.get("stale_dropped", 0)),
            # Trainer vs rollout logprobs of the trained tokens: policy drift within the staleness bound, and
            # ~0 at max_staleness 0 unless the weights the servers run differ from the trainer's.
            "max_abs_logprob_diff": max((s.get("mean_abs_logprob_diff", 0.0) for s in steps), default=0.0),
            "eval": {k: v for k, v in coordinator.items() if k.startswith("eval/")},
            "export_path": str(self.config.export_path()),
            **self.speed_summary(client, steps),
            "rewards": rewards,
            "wall_s": time.monotonic() - self.started,
        }


def _num_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_demo(config: RunConfig, out_dir: Path) -> dict:
    """Run the whole demo; always stops every process; returns and writes the summary."""
    out_dir.mkdir(parents=True, exist_ok=True)
    launcher = DemoLauncher(config, out_dir)
    try:
        redis_url = launcher.start()
        cfg = config.coordinator
        admin = f"{cfg.admin_host}:{cfg.admin_port}" if cfg.admin_port else "(port in logs/coordinator.log)"
        print(
            f"run dir {out_dir} | Redis {redis_url} | logs in {launcher.log_dir} | admin API {admin} "
            "(fleetrl status --admin ADDR)",
            flush=True,
        )
        summary = launcher.monitor(redis_url)
        summary["restarts"] = launcher.restarts()
    finally:
        launcher.stop_all()
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
