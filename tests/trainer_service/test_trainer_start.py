"""A trainer that cannot start, and would fail the same way at every start, exits EXIT_CANNOT_RESTART (78), which
the launcher does not restart (launcher/supervision.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from protos.exit_codes import EXIT_CANNOT_RESTART

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    "override, named",
    [
        ("trainer.no_such_switch=1", "no_such_switch"),  # a configuration refused when read
        ("trainer.megatron.optimizer_state_disk_dir=/tmp/x", "optimizer_state_disk_dir"),  # refused by the backend
    ],
)
def test_a_trainer_whose_configuration_is_refused_exits_cannot_restart_with_the_reason(tmp_path, override, named):
    command = [sys.executable, "-m", "trainer_service", "train", "--model", str(tmp_path), "--redis-url"]
    command += ["redis://127.0.0.1:1/0", override]  # nothing listens there: refused before Redis is opened
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == EXIT_CANNOT_RESTART, done.stderr[-3000:]
    assert named in done.stderr and "Traceback" not in done.stderr


def _torchrun(*argv: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "trainer_service.torchrun", "--standalone", "--nproc-per-node", "2", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=180)


def test_ranks_under_torchrun_whose_configuration_is_refused_exit_cannot_restart(tmp_path):
    """torchrun exits 1 for any failed rank; the trainer's torchrun keeps the ranks' 78, so ``fleetrl demo`` with
    several ranks ends the run instead of restarting the trainer into the same refusal."""
    config = tmp_path / "run.json"
    config.write_text('{"trainer": {"no_such_switch": 1}}')
    done = _torchrun("-m", "trainer_service", "train", "--config", str(config))
    assert done.returncode == EXIT_CANNOT_RESTART, done.stderr[-3000:]
    assert "no_such_switch" in done.stderr


def test_a_rank_that_crashes_otherwise_exits_one_as_torchrun_does(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text("raise SystemExit(3)\n")
    done = _torchrun(str(script))
    assert done.returncode == 1, done.stderr[-3000:]
