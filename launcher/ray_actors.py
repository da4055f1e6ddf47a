"""The Ray actors of ``fleetrl up``; each owns one thing of the run on its node.

* ``RoleActor``: one role process (a rollout server, a trainer rank, the coordinator, valkey) as a ``SupervisedProcess``
  watched by a thread of the actor: restarted by ``launcher.restart`` and reported on request. A trainer rank's actor
  only reports a failure: the driver restarts the trainer's ranks together (ray_launcher.TrainerGang).
* ``RunControl``: the run's named actor (``fleetrl-<run_id>``, see ``control_actor_name``): ``fleetrl down`` and
  ``fleetrl scale`` leave their requests there, the driver picks them up and posts the roles' reports there.

The classes are plain Python (the unit tests drive them in-process); ray_launcher.py wraps them with ``ray.remote``.
"""

from __future__ import annotations

import logging
import socket
import threading
from pathlib import Path

from launcher.roles import ROLLOUT, RoleSpec, read_address
from launcher.supervision import RoleFailed, SupervisedProcess
from protos.config import RestartPolicy

logger = logging.getLogger(__name__)

SCALABLE_ROLES = (ROLLOUT,)


def control_actor_name(run_id: str) -> str:
    return f"fleetrl-{run_id}"


def node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


class RoleActor:
    """Owns one role process on its node; ``start`` may be called again to replace it (a trainer gang restart)."""

    def __init__(self, log_dir: str, policy: dict, cwd: str, restart: bool = True, interval_s: float = 0.2):
        self.log_dir = Path(log_dir)
        self.policy = RestartPolicy(**policy)
        self.cwd = cwd
        self.restart = restart
        self.interval_s = interval_s
        self.process: SupervisedProcess | None = None
        self.error = ""  # the RoleFailed message once the policy gave up
        self.events: list[str] = []  # what happened since the last report (restarts, exits)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def placement(self) -> dict:
        """Where Ray put this actor: node id and IP, and the GPU ids it was given (empty on CPU)."""
        import ray

        context = ray.get_runtime_context()
        gpus = [str(gpu) for gpu in context.get_accelerator_ids().get("GPU", [])]
        return {"node_id": context.get_node_id(), "ip": node_ip(), "gpus": gpus}

    def free_port(self) -> int:
        """A free port on this actor's node (a trainer gang's MASTER_PORT)."""
        with socket.socket() as sock:
            sock.bind(("", 0))
            return sock.getsockname()[1]

    def start(self, spec: RoleSpec) -> int:
        """Start ``spec``'s process (replacing a stopped one) and its supervision; returns its pid."""
        self._join_supervisor()
        with self._lock:
            self.error = ""
            # Ray starts its workers at niceness 15 (its daemons keep the CPU they need); a role is the workload.
            self.process = SupervisedProcess(
                lambda: spec, self.log_dir, self.policy, self.cwd, self.restart, niceness=0
            )
            self.process.start()
        self._stop.clear()
        self._thread = threading.Thread(target=self._supervise, name=f"supervise-{spec.name}", daemon=True)
        self._thread.start()
        return self.process.pid

    def _supervise(self) -> None:
        while not self._stop.wait(self.interval_s):
            with self._lock:
                try:
                    event = self.process.supervise()
                except RoleFailed as error:
                    self.error = str(error)
                    event = self.process.failed
                if event:
                    self.events.append(event)
                    logger.warning("%s", event)

    def report(self) -> dict:
        """The process's report (``SupervisedProcess.report``) with its address (a rollout server, once serving),
        the policy's verdict and the events since the last report."""
        with self._lock:
            if self.process is None:
                return {"state": "new", "error": "", "events": [], "address": None, "restarts": 0, "pid": 0}
            events, self.events = self.events, []
            spec = self.process.spec
            address = read_address(spec) if spec.address_file and self.process.running else None
            return {**self.process.report(), "address": address, "error": self.error, "events": events}

    def stop(self, grace_s: float) -> dict:
        """Stop supervising, then the process (SIGTERM, ``grace_s``, SIGKILL); returns the last report."""
        self._join_supervisor()
        if self.process is not None:
            self.process.stop(grace_s)
        return self.report()

    def _join_supervisor(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


class RunControl:
    """The run's mailbox between the driver and ``fleetrl down|scale`` (named ``control_actor_name(run_id)``)."""

    def __init__(self, run_id: str, out_dir: str):
        self.run_id = run_id
        self.out_dir = out_dir
        self.stop_reason = ""
        self.scale_requests: dict[str, int] = {}
        self.roles: dict[str, dict] = {}

    def request_stop(self, reason: str) -> None:
        self.stop_reason = reason or "stop requested"

    def request_scale(self, role: str, count: int) -> None:
        if role not in SCALABLE_ROLES:
            raise ValueError(f"cannot scale {role!r}: only {', '.join(SCALABLE_ROLES)} scales (e.g. rollout=3)")
        if count < 1:
            raise ValueError(f"{role}={count}: a run needs at least one {role} replica")
        self.scale_requests[role] = count

    def take_requests(self) -> tuple[str, dict[str, int]]:
        """The driver's poll: (stop reason or '', scale requests since the last poll)."""
        requests, self.scale_requests = self.scale_requests, {}
        return self.stop_reason, requests

    def post(self, roles: dict[str, dict]) -> None:
        self.roles = roles

    def report(self) -> dict:
        return {"run_id": self.run_id, "out_dir": self.out_dir, "stop_reason": self.stop_reason, "roles": self.roles}
