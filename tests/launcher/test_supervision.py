"""SupervisedProcess and the restart policy on small real processes: restarts with backoff, giving up after
max_restarts, what counts as finished, stops that take the whole process group."""

from __future__ import annotations

import os
import time

import psutil
import pytest

from launcher.roles import ROLLOUT, TRAINER, RoleSpec
from launcher.supervision import RoleFailed, SupervisedProcess
from protos.config import RestartPolicy, load_run_config
from tests.waiting import wait_until

pytestmark = pytest.mark.integration


def _spec(kind: str, code: str, name: str = "role-x") -> RoleSpec:
    return RoleSpec(name, kind, ("-c", code))


def _exited(role: SupervisedProcess) -> None:
    role.process.wait(timeout=30)


def test_restart_delays_double_up_to_the_cap():
    policy = RestartPolicy(max_restarts=5, backoff_s=0.5, max_backoff_s=3.0)
    assert [policy.delay_s(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_a_cap_below_the_first_delay_is_refused_naming_both_fields():
    with pytest.raises(ValueError, match=r"launcher.restart.max_backoff_s \(0.5\) must not be below"):
        load_run_config(overrides=["launcher.restart.backoff_s=2", "launcher.restart.max_backoff_s=0.5"])


def test_a_failing_role_is_restarted_after_its_backoff_then_given_up_on_with_its_log(tmp_path):
    policy = RestartPolicy(max_restarts=2, backoff_s=1.0, max_backoff_s=10.0)
    role = SupervisedProcess(lambda: _spec(TRAINER, "print('boom'); raise SystemExit(3)"), tmp_path, policy)
    role.start()
    first_pid = role.pid
    _exited(role)
    now = time.monotonic()
    assert role.supervise(now) == "role-x exited with code 3; restart 1 in 1.0s"
    assert role.supervise(now + 0.5) == "" and role.restarts == 0  # backoff not over
    assert role.supervise(now + 1.0) == "role-x restarted (1 of at most 2)"
    assert role.pid != first_pid
    _exited(role)
    assert role.supervise(now + 2.0) == "role-x exited with code 3; restart 2 in 2.0s"  # doubled
    assert role.supervise(now + 4.0) == "role-x restarted (2 of at most 2)"
    _exited(role)
    with pytest.raises(RoleFailed, match=r"role-x exited with code 3; gave up after 2 restarts.*max_restarts=2"):
        role.supervise(now + 5.0)
    assert role.report()["state"] == "failed"
    log = (tmp_path / "role-x.log").read_text()
    assert log.count("boom") == 3 and "start 2 of role-x" in log  # one log, every start marked


def test_a_rollout_server_that_exits_0_is_restarted_but_a_trainer_that_exits_0_has_finished(tmp_path):
    policy = RestartPolicy(max_restarts=1)
    server = SupervisedProcess(lambda: _spec(ROLLOUT, "pass", "rollout-0"), tmp_path, policy)
    trainer = SupervisedProcess(lambda: _spec(TRAINER, "pass", "trainer"), tmp_path, policy)
    for role in (server, trainer):
        role.start()
        _exited(role)
    assert server.supervise().startswith("rollout-0 exited with code 0; restart 1")
    assert trainer.supervise() == "trainer finished" and trainer.report()["state"] == "finished"
    assert trainer.supervise() == ""  # finished stays finished


def test_without_restarts_a_failure_is_reported_not_raised(tmp_path):
    role = SupervisedProcess(lambda: _spec(TRAINER, "raise SystemExit(9)"), tmp_path, RestartPolicy(), restart=False)
    role.start()
    _exited(role)
    assert role.supervise() == "role-x exited with code 9"
    assert role.report()["state"] == "failed" and role.restarts == 0


def test_each_start_asks_for_a_fresh_spec_and_clears_the_address_file(tmp_path):
    address_file = tmp_path / "rollout-0.address"
    starts = []

    def make_spec() -> RoleSpec:
        starts.append(len(starts))
        code = f"open({str(address_file)!r}, 'w').write('127.0.0.1:{7000 + len(starts)}'); raise SystemExit(1)"
        return RoleSpec("rollout-0", ROLLOUT, ("-c", code), address_file=str(address_file))

    role = SupervisedProcess(make_spec, tmp_path, RestartPolicy(backoff_s=0.1))
    role.start()
    _exited(role)
    assert address_file.read_text() == "127.0.0.1:7002"
    role.supervise(0.0)
    role.supervise(1.0)  # the restart: a fresh spec, the old address gone until the new process writes its own
    _exited(role)
    assert address_file.read_text() == "127.0.0.1:7003" and len(starts) == 3


def test_a_stop_takes_down_the_children_of_the_role_process_too(tmp_path):
    # The role starts a child (as a rollout server starts its engine core) and ignores SIGTERM.
    code = (
        "import signal, subprocess, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "subprocess.Popen([sys.executable, '-c', 'import signal; signal.pause()']); print('up', flush=True); "
        "signal.pause()"
    )
    role = SupervisedProcess(lambda: _spec(ROLLOUT, code), tmp_path, RestartPolicy())
    role.start()
    child = wait_until(lambda: psutil.Process(role.pid).children(), "the role's child started", 30)[0]
    role.stop(grace_s=0.5)
    assert not role.running
    child.wait(timeout=10)  # killed with the group; psutil.TimeoutExpired if it outlived the stop
    assert role.supervise() == ""  # a stopped role is not restarted
    assert os.getpgid(os.getpid()) != role.pid  # the role ran in its own group, not the test's


def test_a_role_that_exits_cannot_restart_ends_the_run_at_once_with_its_own_message(tmp_path):
    """The H200 run's find: a configuration the role refuses was restarted three times (~3.5 min) before the run
    gave up; it fails the same way every time."""
    from protos.exit_codes import EXIT_CANNOT_RESTART

    code = f"print('quantization mxfp8 needs receive_mode mxfp8'); raise SystemExit({EXIT_CANNOT_RESTART})"
    role = SupervisedProcess(lambda: _spec(TRAINER, code, "trainer"), tmp_path, RestartPolicy(max_restarts=3))
    role.start()
    _exited(role)
    with pytest.raises(RoleFailed, match=r"(?s)trainer refused to start \(exit code 78\); not restarted.*mxfp8"):
        role.supervise()
    assert role.restarts == 0 and role.restart_at is None and role.report()["state"] == "failed"


def test_a_role_without_restarts_of_its_own_reports_why_a_restart_cannot_fix_its_exit(tmp_path):
    """A Ray trainer rank (restart=False: its gang restarts as a whole) only reports; the report carries the refusal
    for the gang's supervision to act on."""
    from protos.exit_codes import EXIT_CANNOT_RESTART

    code = f"raise SystemExit({EXIT_CANNOT_RESTART})"
    role = SupervisedProcess(lambda: _spec(TRAINER, code, "trainer"), tmp_path, RestartPolicy(), restart=False)
    role.start()
    _exited(role)
    assert role.supervise() == "trainer refused to start (exit code 78)"
    assert role.report()["state"] == "failed" and role.report()["refused"] == "refused to start (exit code 78)"


def test_a_rollout_server_that_exits_before_it_ever_served_is_not_restarted(tmp_path):
    address_file = tmp_path / "rollout-0.address"
    code = "import sys; sys.exit('ValueError: rollout.quantization=mxfp8 is refused')"
    spec = RoleSpec("rollout-0", ROLLOUT, ("-c", code), address_file=str(address_file))
    role = SupervisedProcess(lambda: spec, tmp_path, RestartPolicy(max_restarts=3))
    role.start()
    _exited(role)
    with pytest.raises(RoleFailed, match=r"(?s)rollout-0 exited with code 1 before it was ready.*mxfp8 is refused"):
        role.supervise()
    assert role.restarts == 0 and role.report()["state"] == "failed"


def test_a_rollout_server_that_crashes_after_it_served_is_restarted(tmp_path):
    address_file = tmp_path / "rollout-0.address"
    code = f"open({str(address_file)!r}, 'w').write('127.0.0.1:7001'); import os; os.abort()"
    spec = RoleSpec("rollout-0", ROLLOUT, ("-c", code), address_file=str(address_file))
    role = SupervisedProcess(lambda: spec, tmp_path, RestartPolicy(max_restarts=3, backoff_s=0.1))
    role.start()
    _exited(role)
    assert role.supervise(0.0).startswith("rollout-0 exited with code -6; restart 1")
    assert role.supervise(1.0) == "rollout-0 restarted (1 of at most 3)"
    _exited(role)  # served once: every later exit is a crash, restarted
    assert role.supervise(2.0).startswith("rollout-0 exited with code -6; restart 2")
