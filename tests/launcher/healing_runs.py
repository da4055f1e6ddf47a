"""Helpers of the healing tests (test_launcher_healing.py, test_ray_launcher.py): a `fleetrl demo|up` run as a
process, its admin API, its roles (roles.json), and what its trainer's last checkpoint holds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil
import pytest

from launcher.redis_server import free_port
from protos import admin_pb2, admin_pb2_grpc
from tests.waiting import WaitTimeout, wait_until

GROUPS_PER_STEP, GROUP_SIZE = 4, 4


@dataclass
class LaunchedRun:
    """One `fleetrl demo|up` process and its run directory."""

    process: subprocess.Popen
    out: Path
    admin: str
    output: Path

    @property
    def stub(self) -> admin_pb2_grpc.CoordinatorAdminStub:
        return admin_pb2_grpc.CoordinatorAdminStub(grpc.insecure_channel(self.admin))

    def text(self) -> str:
        logs = sorted((self.out / "logs").glob("*.log")) if (self.out / "logs").exists() else []
        tails = "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in logs)
        return self.output.read_text(errors="replace")[-4000:] + tails

    def roles(self) -> dict:
        return json.loads((self.out / "roles.json").read_text())

    def status(self) -> admin_pb2.GetStatusResponse | None:
        """The coordinator's status, or None while its admin API is not up."""
        try:
            return self.stub.GetStatus(admin_pb2.GetStatusRequest(), timeout=5)
        except grpc.RpcError:
            return None

    def wait_for(self, condition: Callable[[], object], what: str, timeout_s: float) -> object:
        """Poll ``condition`` until it returns a truthy value; the run must stay alive meanwhile."""

        def alive_and_met():
            assert self.process.poll() is None, f"the run ended while waiting for {what}:\n{self.text()}"
            return condition()

        try:
            return wait_until(alive_and_met, what, timeout_s, poll_s=0.2)
        except WaitTimeout as timeout:
            raise AssertionError(f"{timeout}\n{self.text()}") from None

    def kill_role(self, name: str) -> dict:
        """SIGKILL the process group of role ``name`` (its engine processes too); returns its report before."""
        report = self.roles()[name]
        assert report["state"] == "running" and report["pid"], report
        os.killpg(report["pid"], signal.SIGKILL)
        return report

    def wait_replaced(self, server_id: str, old_address: str, timeout_s: float) -> admin_pb2.ServerStatus:
        """Until the coordinator routes to ``server_id`` at a new address, healthy, at the trainer's version."""

        def replaced():
            status = self.status()
            for server in status.servers if status else []:
                fresh = server.server_id == server_id and server.address != old_address and server.healthy
                if fresh and server.policy_version == status.trainer_policy_version:
                    return server
            return None

        return self.wait_for(replaced, f"{server_id} back at a new address and the current version", timeout_s)

    def wait_served(self, address: str, timeout_s: float) -> None:
        def served() -> bool:
            status = self.status()
            return any(s.address == address and s.requests > 0 for s in (status.servers if status else []))

        self.wait_for(served, f"a request routed to {address}", timeout_s)

    def finish(self, timeout_s: float) -> dict:
        """Wait for the run's exit (code 0) and return its summary."""
        try:
            code = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the run did not finish within {timeout_s}s:\n{self.text()}")
        assert code == 0, self.text()
        # Every role process of the run is gone (each names the run directory in its argv); engines and ranks
        # went with their process groups.
        leftovers = [
            p.info["cmdline"]
            for p in psutil.process_iter(["cmdline"])
            if str(self.out) in " ".join(p.info["cmdline"] or [])
        ]
        assert not leftovers, leftovers
        return json.loads((self.out / "summary.json").read_text())

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # the launcher stops every role on the way out
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def launch(verb: list[str], out: Path, model: str, steps: int, *overrides: str) -> LaunchedRun:
    """``fleetrl VERB... --steps STEPS --out OUT`` with small groups, a free admin port and the stream kept."""
    admin_port = free_port()
    output = out.parent / f"{out.name}.out"
    command = [
        sys.executable,
        "-m",
        "launcher.cli",
        *verb,
        "--steps",
        str(steps),
        "--out",
        str(out),
        f"model_path={model}",
        f"groups_per_step={GROUPS_PER_STEP}",
        f"coordinator.group_size={GROUP_SIZE}",
        f"coordinator.admin_port={admin_port}",
        "launcher.restart.backoff_s=0.5",
        *overrides,
    ]
    process = subprocess.Popen(command, stdout=open(output, "wb"), stderr=subprocess.STDOUT)
    return LaunchedRun(process, out, f"127.0.0.1:{admin_port}", output)


def latest_checkpoint_state(out: Path) -> dict:
    """trainer_state.json of the checkpoint that ``checkpoints/latest`` names."""
    root = out / "checkpoints"
    return json.loads((root / (root / "latest").read_text() / "trainer_state.json").read_text())


def assert_every_group_trained_once(summary: dict, out: Path, steps: int) -> None:
    """The surviving lineage of weights (the last checkpoint's ledger) trained each of the run's groups, each once:
    as many distinct groups as the run admits, and exactly their samples. (A restarted coordinator reports only its own
    pushes: the summary's trajectories_produced is checked by the callers whose coordinator ran throughout.)"""
    num_groups = steps * GROUPS_PER_STEP
    state = latest_checkpoint_state(out)
    seen = (
        {k: state[k] for k in ("step", "policy_version", "totals")},
        {k: v for k, v in summary.items() if k != "rewards"},
    )
    assert state["step"] == steps and summary["steps"] == steps, seen
    assert len(state["ledger"]) == num_groups and set(state["ledger"].values()) == {"trained"}, seen
    assert summary["trajectories_trained"] == num_groups * GROUP_SIZE == state["totals"]["samples_trained"], seen
    assert summary["max_staleness_seen"] <= summary["max_staleness_allowed"]
