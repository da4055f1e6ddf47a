"""SIGTERM and SIGHUP stop `fleetrl demo` as Ctrl-C does: no process of the run is left (issue 26: a SIGTERM left
valkey, the rollout server with its engine, the trainer and the coordinator running)."""

from __future__ import annotations

import signal

import psutil
import pytest

from modeling.tiny_model import init_tiny
from tests.launcher.healing_runs import launch

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGHUP])
def test_a_signalled_demo_launcher_stops_every_process_of_its_run(tmp_path, stop_signal):
    run = launch(["demo"], tmp_path / "run", str(init_tiny(tmp_path / "model")), 4, "rollout.num_servers=1")
    try:

        def started() -> bool:
            return (run.out / "roles.json").exists() and {"valkey", "rollout-0", "trainer"} <= set(run.roles())

        run.wait_for(started, "the valkey, rollout and trainer roles", 120)
        launcher = psutil.Process(run.process.pid)
        run.wait_for(lambda: len(launcher.children(recursive=True)) >= 3, "the role processes", 60)
        processes = launcher.children(recursive=True)
        run.process.send_signal(stop_signal)
        assert run.process.wait(timeout=60) == 130, run.text()
    finally:
        if run.process.poll() is None:
            run.process.kill()
            run.process.wait()
    _, alive = psutil.wait_procs(processes, timeout=5)
    assert not alive, [(p.pid, p.cmdline()) for p in alive]
    named = [
        p.info["cmdline"] for p in psutil.process_iter(["cmdline"]) if str(run.out) in " ".join(p.info["cmdline"] or [])
    ]
    assert not named, named  # every role names the run directory in its argv (valkey: its data directory)
