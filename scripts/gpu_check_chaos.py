"""GPU check section ``chaos``: the GPU demo (``fleetrl demo --config recipes/gpu-h200.yaml``) with its trainer
killed mid-step and its rollout server killed mid-stream, each with SIGKILL of the role's process group (the
trainer; the server with its vLLM engine core), as the CPU chaos soak does (docs/chaos.md).

The demo runs as a subprocess and nothing in it knows about the faults: its launcher restarts the killed roles
(``launcher.restart``), the trainer resumes from its last checkpoint and replays the steps it had published since,
the coordinator re-dispatches the killed server's calls once its replacement serves. The section only reads what
the run writes (roles.json, config.json, checkpoints/latest, summary.json, the run's Redis while it runs and its
append-only file after) and reports, per fault, the time lost and the restarts, then the trajectories produced
and trained (exactly once) and the final versions of trainer and servers (scripts/gpu_chaos_report.py).

Order of the run: the first durable checkpoint (a trainer killed before it has nothing to resume from and refuses
to start, by design), then the trainer kill half a step after a step report, then, once the trainer stepped
again, the server kill while its engine is running requests (its heartbeat says so). With one rollout server the
run waits for the replacement's engine to start: that start is the server fault's time lost.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from gpu_chaos_report import (
    FaultRecord,
    StepReport,
    exactly_once,
    fault_rows,
    final_versions,
    median_step_interval_s,
    read_run_streams,
    time_lost,
)
from gpu_check_helpers import DRY, ROOT, Result

RUN_DIR = Path("/tmp/fleetrl-gpu-chaos")  # outside OUT: a checkpoint of the 0.94 B model is ~13 GB
BUDGET_S = 450.0  # under gpu_checks.LIMITS_S["chaos"]: past it the run is stopped (SIGINT) before the outer kill
TRAINER, SERVER = "trainer", "rollout-0"


class ChaosFailed(RuntimeError):
    """The run did not get through the faults: what was waited for, and how the run stood."""


@dataclass(frozen=True)
class ChaosPlan:
    """The demo's command-line arguments: recipe, steps and the overrides the audit needs."""

    config: tuple[str, ...]
    num_steps: int
    overrides: tuple[str, ...]


def chaos_plan() -> ChaosPlan:
    """The GPU recipe (60 steps, a checkpoint every 20: few 13 GB writes), or on a dry run the CPU demo shaped like
    it (one rollout server, small groups). The stream is kept whole for the exactly-once audit."""
    kept = ("trainer.trim_acknowledged=false", "trainer.keep_last_checkpoints=1")
    if DRY:
        small = ("rollout.num_servers=1", "groups_per_step=4", "coordinator.group_size=4")
        return ChaosPlan((), 40, (*kept, "trainer.ckpt_interval=10", *small))
    return ChaosPlan(("--config", "recipes/gpu-h200.yaml"), 60, (*kept, "trainer.ckpt_interval=20"))


class DemoRun:
    """One ``fleetrl demo`` process and what it writes; every wait ends at the section's deadline."""

    def __init__(self, plan: ChaosPlan, run_dir: Path, output: Path):
        self.plan, self.run_dir, self.output = plan, run_dir, output
        self.deadline = time.monotonic() + BUDGET_S
        self.process: subprocess.Popen | None = None
        self._client = None
        self.keys = None

    def start(self) -> list[str]:
        shutil.rmtree(self.run_dir, ignore_errors=True)  # a previous run's checkpoints would fill the disk
        env = {**os.environ, "FLEETRL_CACHE": os.environ.get("FLEETRL_CACHE", "/tmp/fleetrl-cache")}
        command = [sys.executable, "-m", "launcher.cli", "demo", *self.plan.config, "--steps", str(self.plan.num_steps)]
        command += ["--out", str(self.run_dir), *self.plan.overrides]
        with open(self.output, "wb") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        return command

    def stop(self) -> None:
        """SIGINT: the launcher stops every role (engines included), as Ctrl-C does."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def wait_for(self, condition, what: str, timeout_s: float):
        """Poll ``condition`` until truthy while the run goes on; ChaosFailed at the timeout or the deadline."""
        limit = time.monotonic() + min(timeout_s, self.left_s())
        print(f"chaos: waiting up to {limit - time.monotonic():.0f}s for {what}", flush=True)
        while not (value := condition()):
            if self.process.poll() is not None:
                raise ChaosFailed(f"the run ended (exit {self.process.returncode}) while waiting for {what}")
            if time.monotonic() > limit:
                raise ChaosFailed(f"no {what} within {timeout_s:.0f}s (or the section's {BUDGET_S:.0f}s)")
            time.sleep(0.1)
        return value

    # what the run writes ----------------------------------------------------------------------------------------
    def roles(self) -> dict:
        try:
            return json.loads((self.run_dir / "roles.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):  # not written yet
            return {}

    def running(self, name: str) -> dict | None:
        report = self.roles().get(name)
        return report if report and report["state"] == "running" and report["pid"] else None

    def redis(self):
        """The run's Redis (its address from config.json, written before any role starts); None until then."""
        if self._client is None and (self.run_dir / "config.json").exists():
            import redis

            from protos.redis_keys import RedisKeys

            config = json.loads((self.run_dir / "config.json").read_text())
            self._client = redis.Redis.from_url(config["redis_url"], socket_timeout=5)
            self.keys = RedisKeys(config["run_id"])
        return self._client

    def recent_steps(self, count: int = 20) -> list[StepReport]:
        """The trainer's newest step reports, oldest first ([] before the first, or while Redis does not answer)."""
        import redis

        from protos.records import decode_metrics

        client = self.redis()
        if client is None:
            return []
        try:
            entries = client.xrevrange(self.keys.metrics("trainer"), count=count)
        except redis.RedisError:
            return []
        reports = [decode_metrics(fields[b"m"]) for _, fields in entries if b"m" in fields]
        return sorted((StepReport(r.step, r.policy_version, r.time_s) for r in reports), key=lambda r: r.time_s)

    def step(self) -> int:
        steps = self.recent_steps(1)
        return steps[-1].step if steps else 0

    def checkpoint_step(self) -> int:
        """The step of the newest durable checkpoint (``checkpoints/latest`` names it; 0: none yet)."""
        latest = self.run_dir / "checkpoints" / "latest"
        return int(latest.read_text().strip().rsplit("-", 1)[-1]) if latest.exists() else 0


# the faults ---------------------------------------------------------------------------------------------------------
def kill_role(run: DemoRun, record: FaultRecord, restarts_before: int) -> None:
    """SIGKILL of the role's process group, then wait until the launcher restarted it."""
    if record.step_before >= run.plan.num_steps - 1:  # no step left to show the recovery
        raise ChaosFailed(f"the run reached step {record.step_before} of {run.plan.num_steps} before {record.kind}")
    pid = run.running(record.target)["pid"]
    record.injected_s = time.time()
    os.killpg(pid, signal.SIGKILL)  # a role leads its own process group: the engine core / ranks go too
    print(f"chaos: killed {record.target} (pid {pid}) after step {record.step_before}: {record.note}", flush=True)

    def restarted() -> bool:
        report = run.roles().get(record.target, {})
        return report.get("restarts", 0) > restarts_before and report.get("state") == "running"

    run.wait_for(restarted, f"{record.target} restarted by the launcher", 60)
    record.restarted_s = time.time()


def kill_trainer_mid_step(run: DemoRun) -> FaultRecord:
    """Once a checkpoint is durable: half a step after a step report, kill; then wait for its next new step."""
    ckpt = run.wait_for(run.checkpoint_step, "the trainer's first durable checkpoint", 300)
    run.wait_for(lambda: run.step() > ckpt, f"a trainer step after the checkpoint of step {ckpt}", 120)
    seen = run.step()
    run.wait_for(lambda: run.step() > seen, f"the trainer's step after {seen}", 60)
    recent = run.recent_steps()
    intervals = [b.time_s - a.time_s for a, b in zip(recent, recent[1:], strict=False)]
    half_step_s = statistics.median(intervals) / 2 if intervals else 0.0
    time.sleep(half_step_s)  # kept: where in the step the kill lands, not a wait for anything
    before = run.running(TRAINER) or run.wait_for(lambda: run.running(TRAINER), "the trainer running", 30)
    note = f"{half_step_s:.2f}s after a step report (half the median step); last durable checkpoint: step {ckpt}"
    record = FaultRecord("kill_trainer", TRAINER, run.step(), 0.0, note=note)
    kill_role(run, record, before["restarts"])
    run.wait_for(lambda: run.step() > record.step_before, "the restarted trainer's next step", 240)
    return record


def kill_rollout_mid_stream(run: DemoRun) -> FaultRecord:
    """While its engine runs requests: kill; then wait for its replacement to serve and for a new step."""
    from protos.records import decode_report

    def streaming():
        raw = run.redis().hget(run.keys.fleet, SERVER)
        report = decode_report(raw) if raw else None
        fresh = report is not None and time.time() - report.time_s < 3.0
        return report if fresh and report.running > 0 else None

    report = run.wait_for(streaming, f"{SERVER} running requests (its heartbeat's count)", 60)
    before = run.running(SERVER) or run.wait_for(lambda: run.running(SERVER), f"{SERVER} running", 30)
    age_s = time.time() - report.time_s
    note = f"{report.running} requests running, {report.waiting} waiting at its heartbeat {age_s:.1f}s before"
    record = FaultRecord("kill_rollout", SERVER, run.step(), 0.0, note=note)
    kill_role(run, record, before["restarts"])
    address = run.run_dir / f"{SERVER}.address"  # removed at the restart, written once the replacement serves
    run.wait_for(address.exists, f"{SERVER}'s replacement serving (engine start)", 300)
    record.serving_s = time.time()
    run.wait_for(lambda: run.step() > record.step_before, "a trainer step after the server's kill", 120)
    return record


# the section --------------------------------------------------------------------------------------------------------
def section_chaos(result: Result, out: Path) -> None:
    plan = chaos_plan()
    run = DemoRun(plan, RUN_DIR, out / "chaos_demo.out")
    result["command"] = " ".join(run.start())
    faults: list[FaultRecord] = []
    try:
        run.wait_for(lambda: run.step() >= 1, "the trainer's first step (engine start, model build)", 300)
        faults.append(kill_trainer_mid_step(run))
        faults.append(kill_rollout_mid_stream(run))
        print(f"chaos: waiting up to {run.left_s():.0f}s for the run's last step and exit", flush=True)
        result["demo_exit"] = run.process.wait(timeout=max(1.0, run.left_s()))
    except (ChaosFailed, subprocess.TimeoutExpired) as error:
        result["error"] = str(error)
    finally:
        run.stop()
        result["faults_injected"] = [asdict(f) for f in faults]
    try:
        report_run(result, run, faults)
    finally:
        shutil.rmtree(RUN_DIR / "checkpoints", ignore_errors=True)  # ~13 GB each on the GPU; the figures are taken
        shutil.rmtree(RUN_DIR / "export", ignore_errors=True)
    print(f"chaos: passed={result['passed']}", *result.get("rows", []), sep="\n", flush=True)
    if not result["passed"]:
        sys.exit(1)  # gpu_checks.py reports the section failed, with the tail of this log


def report_run(result: Result, run: DemoRun, faults: list[FaultRecord]) -> None:
    """The figures of the run (scripts/gpu_chaos_report.py) into ``result``; ``passed`` when both faults were
    recovered, the run completed, the restarts are the kills, every group was consumed once and the versions agree."""
    run_dir = run.run_dir
    result["passed"] = False
    if not (run_dir / "config.json").exists():  # the launcher stopped before it wrote the run's config
        result["output_tail"] = run.output.read_text(errors="replace")[-2500:]
        return
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    latest = run_dir / "checkpoints" / "latest"
    state_file = (
        run_dir / "checkpoints" / latest.read_text().strip() / "trainer_state.json" if latest.exists() else None
    )
    state = json.loads(state_file.read_text()) if state_file else {}
    config = json.loads((run_dir / "config.json").read_text())
    reports, pushed = read_run_streams(run_dir / "valkey", config["run_id"])
    median_s = median_step_interval_s(reports, faults)
    per_fault = [fault_figures(f, reports, median_s) for f in faults]
    restarts = summary.get("restarts") or {name: r["restarts"] for name, r in run.roles().items()}
    expected = {name: int(name in (TRAINER, SERVER)) for name in restarts}
    once = exactly_once(pushed, state)
    versions = final_versions(state, reports, summary)
    result["median_step_interval_s"] = round(median_s, 3)
    result["faults"] = per_fault
    result["restarts"] = {"seen": restarts, "expected": expected}
    result["exactly_once"] = {**once, "summary_produced": summary.get("trajectories_produced")}
    result["final_versions"] = versions
    result["summary"] = {k: v for k, v in summary.items() if k != "rewards"}
    result["rows"] = fault_rows(per_fault)
    result["passed"] = (
        result.get("demo_exit") == 0
        and len(faults) == 2
        and all(f["time_lost_s"] is not None for f in per_fault)
        and state.get("step") == run.plan.num_steps  # the final checkpoint's step: the run took all its steps
        and restarts == expected
        and once["passed"]
        and versions["agree"]
    )
    result["output_tail"] = run.output.read_text(errors="replace")[-2500:]
    if not result["passed"]:
        logs = sorted((run_dir / "logs").glob("*.log"))
        result["log_tails"] = {log.name: log.read_text(errors="replace")[-2500:] for log in logs}


def fault_figures(fault: FaultRecord, reports: list[StepReport], median_s: float) -> dict:
    def after(moment_s: float) -> float | None:
        return round(moment_s - fault.injected_s, 2) if moment_s else None

    return {
        "kind": fault.kind,
        "target": fault.target,
        "step_before": fault.step_before,
        "where": fault.note,
        "restarted_after_s": after(fault.restarted_s),
        "serving_after_s": after(fault.serving_s),
        **time_lost(fault, reports, median_s),
    }
