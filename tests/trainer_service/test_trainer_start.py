"""A trainer that cannot start, and would fail the same way at every start, exits EXIT_CANNOT_RESTART (78), which
the launcher does not restart (coordinator/supervision.py)."""

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
