"""The chaos soak's run: `fleetrl demo` as a process, its Redis behind the fault proxy, the faults of a schedule.

The soak owns the valkey server (``EmbeddedRedis`` on a fixed port and data dir, AOF with ``appendfsync always``: a
write acknowledged before a SIGKILL survives it) and the fault proxy in front of it (tests/redis_faults.py). The run's
``redis_url`` is the proxy's, so every role's Redis traffic, and the launcher's own, goes through it; the soak itself
reads Redis directly. The launcher supervises the roles as it always does: a killed role is restarted by
``launcher.restart``. A watcher thread records every process the launcher started (engine cores included), so that
the audit can tell whether any outlived the run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import redis

from launcher.redis_server import EmbeddedRedis, free_port
from protos.records import decode_metrics
from protos.redis_keys import RedisKeys
from tests.chaos.schedule import CONNECTION_CUT, KILL_ROLLOUT, REDIS_RESTART, Fault, SoakSize
from tests.redis_faults import redis_proxy
from tests.waiting import WaitTimeout, wait_until

RUN_ID = "chaos"
GROUPS_PER_STEP, GROUP_SIZE, MAX_STALENESS = 4, 4, 1
NUM_ROLLOUT_SERVERS = 2
RECOVERY_TIMEOUT_S = 300.0  # a rollout server's engine start on a busy 2-core machine, with margin


class SoakFailed(AssertionError):
    """The run did not get through its schedule: what it waited for, and the tails of its logs."""


@dataclass
class FaultRecord:
    """A fault as it happened (wall times, time.time(): the roles' reports carry the same clock)."""

    fault: Fault
    step_before: int  # the last step the trainer had reported when it was injected
    injected_s: float
    ended_s: float = 0.0  # the outage is over (a kill: its moment)
    recovered_s: float = 0.0  # the launcher restarted the role / Redis answers through the proxy again
    serving_s: float = 0.0  # a killed rollout server's replacement serves (0: not before the run ended)

    def as_dict(self) -> dict:
        return {
            "kind": self.fault.kind,
            "target": self.fault.target,
            "after_step": self.fault.after_step,
            "step_before": self.step_before,
            "duration_s": self.fault.duration_s,
            "injected_s": self.injected_s,
            "ended_s": self.ended_s,
            "recovered_s": self.recovered_s,
            "serving_s": self.serving_s,
        }


@dataclass
class ProcessWatch:
    """Every process the launcher started, and every role session, seen while the run went on."""

    seen: dict[tuple[int, float], str] = field(default_factory=dict)  # (pid, create time) -> name
    role_sessions: set[int] = field(default_factory=set)  # role leaders' pids = their session ids

    def sample(self, launcher_pid: int, roles: dict) -> None:
        self.role_sessions |= {report["pid"] for report in roles.values() if report.get("pid")}
        try:
            children = psutil.Process(launcher_pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for child in children:
            try:
                self.seen[(child.pid, child.create_time())] = child.name()
            except psutil.NoSuchProcess:
                continue

    def survivors(self, timeout_s: float = 15.0) -> list[str]:
        """Processes of the run still alive ``timeout_s`` after the launcher exited (a process SIGKILLed by its stop
        takes a moment to die; a zombie waiting for init to reap it counts as gone): any descendant seen, or any
        process in a role's session."""
        try:
            wait_until(lambda: not self._alive(), "every process of the run gone", timeout_s, poll_s=0.2)
            return []
        except WaitTimeout:
            return self._alive()

    def _alive(self) -> list[str]:
        alive = set()
        for (pid, created), name in self.seen.items():
            try:
                process = psutil.Process(pid)
                if process.create_time() == created and process.status() != psutil.STATUS_ZOMBIE:
                    alive.add(f"{pid} {name}")
            except psutil.NoSuchProcess:
                continue
        for process in psutil.process_iter(["name", "status"]):
            try:
                in_role_session = os.getsid(process.pid) in self.role_sessions
            except (ProcessLookupError, PermissionError):
                continue
            if in_role_session and process.info["status"] != psutil.STATUS_ZOMBIE:
                alive.add(f"{process.pid} {process.info['name']} (session of a role)")
        return sorted(alive)


class ChaosRun:
    """One soak: ``start()``, ``inject(schedule)``, ``finish()``; ``close()`` always (stops whatever is left)."""

    def __init__(self, workdir: Path, model_dir: str, size: SoakSize, seed: int, *overrides: str):
        self.workdir = workdir
        self.out = workdir / "run"
        self.output = workdir / "demo.out"
        self.size = size
        self.seed = seed
        self.overrides = overrides
        self.model_dir = model_dir
        self.keys = RedisKeys(RUN_ID)
        self.redis = EmbeddedRedis(port=free_port(), data_dir=str(workdir / "valkey"))
        self.stack = ExitStack()
        self.proxy = None
        self.proxy_url = ""
        self.process: subprocess.Popen | None = None
        self.watch = ProcessWatch()
        self.records: list[FaultRecord] = []
        self.started_s = 0.0
        self._stop_watching = threading.Event()
        self._watcher: threading.Thread | None = None

    # start and stop -----------------------------------------------------------------------------------------------
    def start(self) -> None:
        (self.workdir / "valkey").mkdir(parents=True, exist_ok=True)
        self.redis.start()
        self.proxy_url, self.proxy = self.stack.enter_context(redis_proxy(self.redis.url))
        self.direct = redis.Redis.from_url(self.redis.url, socket_timeout=5)
        self.started_s = time.time()
        command = [sys.executable, "-m", "launcher.cli", "demo", "--steps", str(self.size.num_steps)]
        command += ["--out", str(self.out), *self.run_overrides()]
        self.process = subprocess.Popen(command, stdout=open(self.output, "wb"), stderr=subprocess.STDOUT)
        self._watcher = threading.Thread(target=self._watch, name="chaos-process-watch", daemon=True)
        self._watcher.start()

    def run_overrides(self) -> list[str]:
        """The soak's run: small groups, the stream kept (the audit reads every pushed group), restarts quick and
        bounded by more than the schedule's kills."""
        return [
            f"run_id={RUN_ID}",
            f"model_path={self.model_dir}",
            f"redis_url={self.proxy_url}",
            f"groups_per_step={GROUPS_PER_STEP}",
            f"max_staleness={MAX_STALENESS}",
            f"coordinator.group_size={GROUP_SIZE}",
            f"rollout.num_servers={NUM_ROLLOUT_SERVERS}",
            f"coordinator.admin_port={free_port()}",
            "trainer.trim_acknowledged=false",
            "launcher.restart.backoff_s=0.5",
            "launcher.restart.max_backoff_s=2",
            f"launcher.restart.max_restarts={1 + sum(self.size.faults_per_kind.values())}",
            *self.overrides,
        ]

    def _watch(self) -> None:
        while not self._stop_watching.is_set():
            self.watch.sample(self.process.pid, self.roles())
            for record in self.records:  # a restarted rollout server writes its address once it serves
                if record.fault.kind == KILL_ROLLOUT and record.recovered_s and not record.serving_s:
                    if (self.out / f"{record.fault.target}.address").exists():
                        record.serving_s = time.time()
            self._stop_watching.wait(0.2)

    def close(self) -> None:
        """Stop the run if it still goes (SIGINT: the launcher stops every role), the proxy and valkey."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._stop_watching.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        self.stack.close()
        self.redis.stop()

    def finish(self, timeout_s: float) -> int:
        """Wait for the launcher's exit; returns its exit code (its roles are stopped by then)."""
        try:
            code = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired as error:
            raise SoakFailed(f"the run did not finish within {timeout_s}s:\n{self.text()}") from error
        self._stop_watching.set()
        self._watcher.join(timeout=5)
        return code

    # what the run shows -------------------------------------------------------------------------------------------
    def roles(self) -> dict:
        try:
            return json.loads((self.out / "roles.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def trainer_step(self) -> int:
        """The last step the trainer reported (0 before the first, or while Redis is down: the caller waits on)."""
        try:
            newest = self.direct.xrevrange(self.keys.metrics("trainer"), count=5)
        except redis.RedisError:
            return 0
        steps = [decode_metrics(fields[b"m"]).step for _, fields in newest if b"m" in fields]
        return max(steps, default=0)

    def text(self) -> str:
        logs = sorted((self.out / "logs").glob("*.log")) if (self.out / "logs").exists() else []
        tails = "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-2500:]}" for p in logs)
        return self.output.read_text(errors="replace")[-4000:] + tails

    def wait_for(self, condition, what: str, timeout_s: float):
        """Poll ``condition`` until truthy; the run must keep going meanwhile."""

        def running_and_met():
            if self.process.poll() is not None:
                raise SoakFailed(
                    f"the run ended (code {self.process.returncode}) while waiting for {what}\n{self.text()}"
                )
            return condition()

        try:
            return wait_until(running_and_met, what, timeout_s, poll_s=0.1)
        except WaitTimeout:
            raise SoakFailed(f"no {what} within {timeout_s:.0f}s\n{self.text()}") from None

    # faults -------------------------------------------------------------------------------------------------------
    def inject(self, schedule: list[Fault], start_timeout_s: float = 600.0) -> None:
        """Each fault once it is due, the one before has recovered (a killed role restarted, Redis answering) and the
        run has made a step since; a run that ends first fails the soak (its schedule is too dense for its steps)."""
        for number, fault in enumerate(schedule, 1):
            timeout_s = start_timeout_s if number == 1 else RECOVERY_TIMEOUT_S
            what = f"step {fault.after_step} (fault {number} of {len(schedule)}: {fault.kind} {fault.target})"
            self.wait_for(lambda f=fault: self.trainer_step() >= f.after_step, what, timeout_s)
            time.sleep(fault.delay_s)  # kept: the schedule's own delay, where in the step the fault lands
            if self.trainer_step() >= self.size.num_steps:  # nothing would show the recovery
                raise SoakFailed(f"the run ended before fault {number} ({fault.kind}): schedule too dense for its pace")
            record = FaultRecord(fault, self.trainer_step(), time.time())
            print(f"chaos: injecting {fault.kind} {fault.target} after step {record.step_before}", flush=True)
            self._inject_one(record)
            self.records.append(record)
            if number < len(schedule):  # the next fault comes once the run made progress: each has its time lost
                what = f"a step after fault {number} ({fault.kind} {fault.target})"
                self.wait_for(lambda r=record: self.trainer_step() > r.step_before, what, RECOVERY_TIMEOUT_S)

    def _inject_one(self, record: FaultRecord) -> None:
        fault = record.fault
        outages = {
            REDIS_RESTART: (self.redis.kill, self.redis.start),
            CONNECTION_CUT: (self.proxy.cut, self.proxy.restore),
        }
        if fault.kind in outages:
            begin, end = outages[fault.kind]
            begin()
            time.sleep(fault.duration_s)  # kept: the outage lasts this long by design
            end()
            record.ended_s = time.time()
            self.wait_for(self._answers_through_proxy, "Redis answering through the proxy", RECOVERY_TIMEOUT_S)
        else:
            before = self.wait_for(lambda: self._running(fault.target), f"{fault.target} running", RECOVERY_TIMEOUT_S)
            os.killpg(before["pid"], signal.SIGKILL)  # the whole group: a server's engine core, the trainer's ranks
            record.ended_s = time.time()
            self.wait_for(
                lambda: self._restarted(fault, before["restarts"]),
                f"{fault.target} restarted by the launcher",
                RECOVERY_TIMEOUT_S,
            )
        record.recovered_s = time.time()

    def _answers_through_proxy(self) -> bool:
        client = redis.Redis.from_url(self.proxy_url, socket_timeout=2)
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()

    def _running(self, name: str) -> dict | None:
        report = self.roles().get(name)
        return report if report and report["state"] == "running" and report["pid"] else None

    def _restarted(self, fault: Fault, restarts_before: int) -> bool:
        """The launcher restarted the role (a rollout server's replacement serving again is watched for apart:
        its engine's start takes long enough for the next faults to come meanwhile)."""
        report = self.roles().get(fault.target, {})
        return report.get("restarts", 0) > restarts_before and report.get("state") in ("running", "finished")
