"""Reaching a run started by ``fleetrl up``: its Ray cluster, its state file and its named ``RunControl`` actor.

``fleetrl up`` writes ``<run dir>/ray_run.json`` (run id, the cluster's address, the namespace). ``fleetrl down`` and
``fleetrl scale`` read it (``--run-dir``), or take ``--ray ADDRESS --run-id ID``, join the cluster, and leave their
request with the run's ``RunControl`` actor; the driver acts on it within a second or so.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

STATE_FILE = "ray_run.json"
AUTH_MODE_ENV = "RAY_AUTH_MODE"  # Ray's own variable; a cluster Ray starts on this machine is "token"
FLEETRL_ROOT = Path(__file__).resolve().parents[1]  # where the fleetrl packages are imported from


class RunNotFound(RuntimeError):
    """No run of that id is up (its driver ended, or the address or namespace is another cluster's)."""


@dataclass(frozen=True)
class RunLocation:
    """How to reach a run: the Ray cluster, the namespace of its actors, its run id (and its directory)."""

    ray_address: str
    namespace: str
    run_id: str
    out_dir: str = ""
    driver_pid: int = 0
    auth_mode: str = ""  # RAY_AUTH_MODE of the cluster ("token": clients must send the token in ~/.ray/auth_token)


def write_state(out_dir: Path, location: RunLocation) -> Path:
    path = out_dir / STATE_FILE
    path.write_text(json.dumps(asdict(location), indent=2))
    return path


def read_state(run_dir: Path) -> RunLocation:
    path = Path(run_dir) / STATE_FILE
    try:
        return RunLocation(**json.loads(path.read_text()))
    except FileNotFoundError:
        raise RunNotFound(f"{path} does not exist: is {run_dir} the run directory of a `fleetrl up` run?") from None


def connect(address: str, namespace: str, num_cpus: int | None = None) -> None:
    """Join the cluster at ``address`` ('auto', HOST:PORT, ray://...), or start one on this machine ('local').

    Role processes import fleetrl from where this process does (workers of a joined cluster start elsewhere).
    """
    import ray

    python_path = os.pathsep.join(p for p in (str(FLEETRL_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    options = {
        "namespace": namespace,
        "log_to_driver": False,  # every role writes its own log in the run directory
        "runtime_env": {"env_vars": {"PYTHONPATH": python_path}},
        "configure_logging": False,
    }
    if address == "local":
        ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, **options)
    else:
        ray.init(address=address, **options)


def control_actor(location: RunLocation):
    """The run's RunControl actor; raises RunNotFound."""
    import ray

    from launcher.ray_actors import control_actor_name

    _check_reachable(location)
    connect(location.ray_address, location.namespace)
    try:
        return ray.get_actor(control_actor_name(location.run_id), namespace=location.namespace)
    except ValueError:
        raise RunNotFound(
            f"no run {location.run_id!r} is up on the Ray cluster at {location.ray_address} (namespace "
            f"{location.namespace!r}); it has finished or was stopped"
        ) from None


def use_auth_mode(location: RunLocation) -> None:
    """A joining client sends no token unless told that the cluster wants one; Ray reads the mode when it is
    imported, so this comes first."""
    if location.auth_mode:
        os.environ.setdefault(AUTH_MODE_ENV, location.auth_mode)


def _check_reachable(location: RunLocation, timeout_s: float = 5.0) -> None:
    """A cluster that is gone (a local one ends with its run) is RunNotFound at once: Ray would retry for minutes."""
    host, sep, port = location.ray_address.rpartition(":")
    if not sep or not port.isdigit() or "://" in location.ray_address:
        return  # 'auto', ray://: Ray resolves those itself
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as error:
        raise RunNotFound(
            f"the Ray cluster of run {location.run_id!r} at {location.ray_address} is not reachable ({error}); "
            "the run has ended"
        ) from None


def request_down(location: RunLocation, wait_s: float) -> bool:
    """Ask the run to stop; True once its driver is gone (its control actor with it) within ``wait_s``."""
    use_auth_mode(location)
    import ray

    control = control_actor(location)
    ray.get(control.request_stop.remote("fleetrl down"), timeout=30)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            ray.get(control.report.remote(), timeout=10)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return True
        time.sleep(0.5)
    return False


def request_scale(location: RunLocation, role: str, count: int, wait_s: float) -> dict:
    """Ask for ``count`` replicas of ``role``; waits up to ``wait_s`` for them to serve. Returns the last report.

    Raises ValueError for a role that does not scale or a bad count (the driver's RunControl checks it).
    """
    use_auth_mode(location)
    import ray

    control = control_actor(location)
    try:
        ray.get(control.request_scale.remote(role, count), timeout=30)
    except ray.exceptions.RayTaskError as error:
        raise ValueError(str(error.cause)) from None
    deadline = time.monotonic() + wait_s
    while True:
        report = ray.get(control.report.remote(), timeout=30)
        if serving_replicas(report, role) == count or time.monotonic() >= deadline:
            return report
        time.sleep(0.5)


def serving_replicas(report: dict, role: str) -> int:
    """Replicas of ``role`` in the driver's last report that run and (for rollout servers) serve, none leaving."""
    replicas = [r for r in report["roles"].values() if r.get("kind") == role]
    if any(r.get("leaving") for r in replicas):
        return -1
    return sum(1 for r in replicas if r.get("state") == "running" and r.get("address"))
