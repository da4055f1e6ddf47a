"""SupervisedProcess: one role process, restarted after a failure by the run's restart policy.

Both launchers supervise with it: ``fleetrl demo`` holds one per role on this machine, and in ``fleetrl up`` each
Ray actor holds one on its node. A process runs in its own session (a stop takes down its vLLM engine processes or
its torchrun ranks too) and appends its output to ``logs/<name>.log``. A rollout server that exits, or any role that
exits non-zero, is restarted after ``launcher.restart`` backoff (``backoff_s``, doubled per restart, at most
``max_backoff_s``); one failure more than ``max_restarts`` raises ``RoleFailed``, which ends the run with the role's
name, exit code and last log lines. What a restart cannot fix ends the run at the first failure, with the same
message: a role that exits ``EXIT_CANNOT_RESTART`` (protos/exit_codes.py: its configuration refused, a module
missing, a model that does not fit, a trainer with no checkpoint behind a published version), and a role with a
readiness signal (a rollout server's address file) that exits before it was ever ready. What a restart resumes is the role's own business: a rollout server catches up to
the latest version and registers again, the trainer resumes from its checkpoint, the coordinator from its cursor.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from launcher.roles import RoleSpec
from protos.config import RestartPolicy
from protos.exit_codes import EXIT_CANNOT_RESTART

logger = logging.getLogger(__name__)


class RoleFailed(RuntimeError):
    """A role process failed and the restart policy gives up on it (or a role could not start)."""


def write_roles(out_dir: Path, reports: dict[str, dict]) -> None:
    """``roles.json`` in the run directory: every role's pid, restarts and state (replaced whole: a reader never
    sees half of it). What an operator, or a test, looks at to find a role's process."""
    partial = out_dir / "roles.json.partial"
    partial.write_text(json.dumps(reports, indent=2))
    partial.rename(out_dir / "roles.json")


def set_niceness(pid: int, niceness: int) -> None:
    """Set ``pid``'s scheduling niceness before it starts its own processes; where lowering it is not permitted
    (no CAP_SYS_NICE), it keeps the launcher's."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, niceness)
    except PermissionError:
        logger.info("pid %d keeps niceness %d (lowering it to %d is not permitted)", pid, os.nice(0), niceness)


class RestartBackoff:
    """The restart policy's bookkeeping for one restartable unit (a role process, the Ray trainer's gang): restarts so
    far and when the next is due (``launcher.restart``: ``backoff_s`` doubled per restart, at most ``max_backoff_s``;
    at most ``max_restarts``). The unit says what a failure and a restart are; this says when."""

    def __init__(self, policy: RestartPolicy):
        self.policy = policy
        self.restarts = 0
        self.restart_at: float | None = None  # monotonic time of a scheduled restart

    def start(self) -> None:
        raise NotImplementedError

    def restart_when_due(self, now_s: float, what: str) -> str | None:
        """None where no restart is scheduled; "" while its backoff runs; once it is due, counts it, calls
        ``start()`` and says so."""
        if self.restart_at is None:
            return None
        if now_s < self.restart_at:
            return ""
        self.restart_at = None
        self.restarts += 1
        self.start()
        return f"{what} restarted ({self.restarts} of at most {self.policy.max_restarts})"

    def restarts_exhausted(self) -> bool:
        return self.restarts >= self.policy.max_restarts

    def schedule_restart(self, now_s: float) -> float:
        """Schedule the next restart after its backoff; returns the backoff in seconds."""
        delay_s = self.policy.delay_s(self.restarts + 1)
        self.restart_at = now_s + delay_s
        return delay_s


def log_tail(path: Path, num_chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-num_chars:]
    except FileNotFoundError:
        return "(no log)"


class SupervisedProcess(RestartBackoff):
    """One role process; ``make_spec`` is asked again at every (re)start (a coordinator's server list may change)."""

    def __init__(
        self,
        make_spec: Callable[[], RoleSpec],
        log_dir: Path,
        policy: RestartPolicy,
        cwd: str | None = None,
        restart: bool = True,
        niceness: int | None = None,
    ):
        super().__init__(policy)
        self.make_spec = make_spec
        self.spec = make_spec()
        self.log_dir = Path(log_dir)
        self.cwd = cwd
        self.restart = restart  # False: a failure is only reported (a Ray trainer gang restarts as a whole)
        self.niceness = niceness  # the process's, where the launcher runs at another (None: inherit)
        self.process: subprocess.Popen | None = None
        self.finished = False  # exited 0 with its work done
        self.failed = ""  # why it is down for good ("" = not)
        self.refused = ""  # why a restart cannot fix its exit ("" = it may), for a supervisor above (a trainer gang)
        self.served = False  # ready in some start (a rollout server wrote its address): a later exit is a crash
        self.stopping = False

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.spec.name}.log"

    @property
    def pid(self) -> int:
        return self.process.pid if self.process is not None else 0

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        self.spec = self.make_spec()
        if self.spec.address_file:  # the new process writes its own once it serves
            Path(self.spec.address_file).unlink(missing_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"---- fleetrl: start {self.restarts} of {self.spec.name} ----\n".encode())
            self.process = subprocess.Popen(
                [sys.executable, *self.spec.argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.spec.env},
                cwd=self.cwd,
                start_new_session=True,
            )
        if self.niceness is not None:
            set_niceness(self.process.pid, self.niceness)

    def supervise(self, now_s: float | None = None) -> str:
        """Look at the process and restart it when due; returns what happened ('' = nothing new).

        Raises ``RoleFailed`` when it failed once more than the policy allows.
        """
        now_s = time.monotonic() if now_s is None else now_s
        if self.stopping or self.finished or self.failed or self.process is None:
            return ""
        restarting = self.restart_when_due(now_s, self.name)
        if restarting is not None:
            return restarting
        code = self.process.poll()
        self.served = self.served or self.serving_now()
        if code is None:
            return ""
        if code == 0 and not self.spec.serves_until_stopped:
            self.finished = True
            return f"{self.name} finished"
        self.kill_group()  # engine processes or ranks the dead leader left behind
        refused = self.unrestartable(code)
        if refused:
            self.failed, self.refused = f"{self.name} {refused}", refused
            if not self.restart:
                return self.failed
            raise RoleFailed(
                f"{self.failed}; not restarted (it would fail the same way); last log lines:\n{log_tail(self.log_path)}"
            )
        if not self.restart:
            self.failed = f"{self.name} exited with code {code}"
            return self.failed
        if self.restarts_exhausted():
            self.failed = f"{self.name} exited with code {code}"
            raise RoleFailed(
                f"{self.failed}; gave up after {self.restarts} restarts (launcher.restart.max_restarts="
                f"{self.policy.max_restarts}); last log lines:\n{log_tail(self.log_path)}"
            )
        delay_s = self.schedule_restart(now_s)
        return f"{self.name} exited with code {code}; restart {self.restarts + 1} in {delay_s:.1f}s"

    def serving_now(self) -> bool:
        """Whether this start is serving: a role with an address file has written it (``start`` removed the old)."""
        return bool(self.spec.address_file) and Path(self.spec.address_file).exists()

    def unrestartable(self, code: int) -> str:
        """Why a restart cannot fix this exit ("" where it may): the role said so (EXIT_CANNOT_RESTART: a
        configuration or a run state it refuses), or it never served in any start (a rollout server whose
        configuration, imports or model fail before its engine is up fails the same way at every start)."""
        if code == EXIT_CANNOT_RESTART:
            return f"refused to start (exit code {code})"
        if self.spec.address_file and not self.served:
            return f"exited with code {code} before it was ready (it never served)"
        return ""

    def terminate(self) -> None:
        """First half of a stop: SIGTERM to the process group (graceful: a rollout server drains); no restart."""
        self.stopping = True
        if self.running:
            os.killpg(self.process.pid, signal.SIGTERM)

    def wait_stopped(self, deadline_s: float) -> None:
        """Second half: wait until the monotonic ``deadline_s``, then SIGKILL whatever is left of the group."""
        if self.process is None:
            return
        try:
            self.process.wait(timeout=max(0.1, deadline_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop within its grace period; killing it", self.name)
        self.kill_group()
        self.process.wait()

    def stop(self, grace_s: float = 10.0) -> None:
        self.terminate()
        self.wait_stopped(time.monotonic() + grace_s)

    def kill_group(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def report(self) -> dict:
        """What a launcher shows and records (roles.json): pid, restarts and state of this role."""
        state = "failed" if self.failed else "finished" if self.finished else "running" if self.running else "down"
        report = {"name": self.name, "kind": self.spec.kind, "pid": self.pid, "restarts": self.restarts, "state": state}
        return {**report, "refused": self.refused}
