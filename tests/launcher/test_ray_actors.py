"""The Ray side of fleetrl up on a real local Ray cluster (one per module), with small stand-in role processes in
place of vLLM: a RoleActor restarts its killed process and reports it; RolloutReplicas places, starts, retires and
releases replicas, and gives up on one the cluster cannot hold; RunControl is found by name and carries
`fleetrl down` to the driver."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import ray

from launcher.ray_actors import RoleActor, RunControl, control_actor_name
from launcher.ray_control import AUTH_MODE_ENV, FLEETRL_ROOT, RunLocation, connect, write_state
from launcher.ray_launcher import RayLauncher, RunStopped
from launcher.ray_placement import actor_options
from launcher.ray_replicas import RolloutReplicas
from launcher.roles import ROLLOUT, RoleSpec
from protos.config import RestartPolicy, load_run_config
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

NAMESPACE = "fleetrl-actor-tests"


@pytest.fixture(scope="module")
def cluster():
    connect("local", NAMESPACE, num_cpus=4)
    try:
        yield
    finally:
        ray.shutdown()


def _server_spec(out_dir: Path, index: int) -> RoleSpec:
    """A stand-in rollout server: writes host:port to its address file, then serves (blocks) until stopped."""
    name = f"rollout-{index}"
    address_file = out_dir / f"{name}.address"
    code = f"import signal; open({str(address_file)!r}, 'w').write('127.0.0.1:{9000 + index}'); signal.pause()"
    return RoleSpec(name, ROLLOUT, ("-c", code), address_file=str(address_file))


def _actor_options(tmp_path: Path) -> dict:
    policy = RestartPolicy(backoff_s=0.2).model_dump()
    return {"log_dir": str(tmp_path / "logs"), "policy": policy, "cwd": str(FLEETRL_ROOT)}


def test_a_role_actor_restarts_its_killed_process_and_reports_it(cluster, tmp_path):
    actor = ray.remote(RoleActor).options(num_cpus=0.1).remote(**_actor_options(tmp_path))
    first_pid = ray.get(actor.start.remote(_server_spec(tmp_path, 0)))
    wait_until(lambda: ray.get(actor.report.remote())["address"], "address", 60, poll_s=0.1)
    os.killpg(first_pid, signal.SIGKILL)
    events: list[str] = []

    def restarted():
        report = ray.get(actor.report.remote())
        events.extend(report["events"])
        return report if report["restarts"] == 1 and report["address"] else None

    report = wait_until(restarted, "restart", 60, poll_s=0.1)
    assert report["pid"] != first_pid and report["state"] == "running" and report["address"] == "127.0.0.1:9000"
    assert events[0] == "rollout-0 exited with code -9; restart 1 in 0.2s" and events[1].startswith(
        "rollout-0 restarted"
    )
    assert ray.get(actor.stop.remote(5.0))["state"] == "down"
    assert ray.get(actor.placement.remote())["gpus"] == []  # a CPU actor
    ray.kill(actor)


def test_replicas_scale_up_in_the_background_and_down_by_retiring_the_newest(cluster, tmp_path):
    config = load_run_config(overrides=["run_id=replica-test", "launcher.ray.rollout_cpus=0.5"])

    def make_actor(resources, group):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options = {**actor_options(resources), "scheduling_strategy": PlacementGroupSchedulingStrategy(group, 0)}
        return ray.remote(RoleActor).options(**options).remote(**_actor_options(tmp_path))

    replicas = RolloutReplicas(config, lambda index, host: _server_spec(tmp_path, index), make_actor, local=True)
    replicas.add(wait=True)
    assert list(replicas.serving) == ["rollout-0"]
    assert replicas.scale_to(3) == "scaling rollout servers 1 -> 3"
    assert set(replicas.transient_reports()) == {"rollout-1", "rollout-2"}  # placing, not yet started
    events: list[str] = []

    def all_started() -> bool:
        events.extend(replicas.advance())
        return len(replicas.serving) == 3

    wait_until(all_started, "three started replicas", 60, poll_s=0.1)
    assert sorted(events) == ["rollout-1 placed and starting", "rollout-2 placed and starting"]
    assert replicas.scale_to(1) == "scaling rollout servers 3 -> 1"
    assert list(replicas.serving) == ["rollout-0"] and set(replicas.leaving) == {"rollout-1", "rollout-2"}
    assert all(r["leaving"] for r in replicas.transient_reports().values())
    stopped: list[str] = []
    wait_until(
        lambda: stopped.extend(replicas.advance()) or not replicas.leaving, "retired replicas stopped", 60, poll_s=0.1
    )
    assert sorted(stopped) == ["rollout-1 stopped", "rollout-2 stopped"]
    ray.get(replicas.stop_refs(5.0))
    replicas.release()
    assert replicas.num_made == 3  # indices are never reused


def test_a_replica_the_cluster_cannot_hold_is_given_up_and_the_run_goes_on(cluster, tmp_path):
    config = load_run_config(
        overrides=["run_id=too-big", "launcher.ray.rollout_cpus=64", "launcher.ray.placement_timeout_s=1"]
    )
    replicas = RolloutReplicas(config, lambda index, host: _server_spec(tmp_path, index), None, local=True)
    replicas.scale_to(1)
    events = wait_until(lambda: replicas.advance() or None, "a verdict on the placement", 30, poll_s=0.1)
    assert events[0].startswith("rollout-0 not placed within 1s (launcher.ray.placement_timeout_s)")
    assert not replicas.placing and not replicas.serving


def test_the_run_control_actor_is_found_by_its_run_id(cluster):
    control = ray.remote(RunControl).options(name=control_actor_name("named"), num_cpus=0).remote("named", "/r")
    found = ray.get_actor(control_actor_name("named"), namespace=NAMESPACE)
    ray.get(found.request_scale.remote("rollout", 2))
    assert ray.get(control.take_requests.remote()) == ("", {"rollout": 2})
    with pytest.raises(ValueError, match="already taken"):  # a second driver of the same run id is refused
        ray.remote(RunControl).options(name=control_actor_name("named"), num_cpus=0).remote("named", "/r")
    ray.kill(control)


def _fleetrl(*argv: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "launcher.cli", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=FLEETRL_ROOT)


def test_fleetrl_down_reaches_the_driver_through_the_run_control_actor(cluster, tmp_path):
    control = ray.remote(RunControl).options(name=control_actor_name("down-test"), num_cpus=0).remote("down-test", "")
    address = ray.get_runtime_context().gcs_address
    auth_mode = os.environ.get(AUTH_MODE_ENV, "")
    write_state(tmp_path, RunLocation(address, NAMESPACE, "down-test", str(tmp_path), os.getpid(), auth_mode))
    asked = _fleetrl("down", "--run-dir", str(tmp_path), "--wait-s", "1")
    assert asked.returncode == 1 and "run down-test asked to stop; still stopping after 1s" in asked.stdout, asked
    launcher = RayLauncher(load_run_config(overrides=["run_id=down-test"]), tmp_path)
    launcher.control = control
    with pytest.raises(RunStopped, match="fleetrl down"):  # the driver's next look at the run
        launcher._act_on_requests()
    ray.kill(control)
    gone = _fleetrl("down", "--ray", address, "--run-id", "down-test", "--namespace", NAMESPACE)
    assert gone.returncode == 2 and "no run 'down-test' is up" in gone.stderr, gone


def test_a_trainer_rank_that_refuses_to_start_ends_the_run_instead_of_restarting_the_gang(cluster, tmp_path):
    """A rank exiting EXIT_CANNOT_RESTART (here: its config file refused) would fail the same way at every gang
    restart: the gang's supervision ends the run with the rank's own message at the first failure."""
    from launcher.ray_placement import TrainerGang
    from launcher.supervision import RoleFailed

    config = load_run_config(overrides=["launcher.restart.max_restarts=3"])
    config_path = tmp_path / "config.json"
    config_path.write_text('{"trainer": {"no_such_switch": 1}}')
    gang = TrainerGang(config, config_path, {"log_dir": str(tmp_path / "logs"), "cwd": os.getcwd()}, local=True)
    try:
        gang.start()

        def failed() -> list[dict] | None:
            reports = ray.get(gang.report_refs(), timeout=60)
            return reports if any(r["state"] == "failed" for r in reports) else None

        reports = wait_until(failed, "the refusing trainer rank to exit", 120)
        assert reports[0]["refused"] == "refused to start (exit code 78)"
        with pytest.raises(
            RoleFailed,
            match=r"(?s)trainer refused to start \(exit code 78\); the trainer is not "
            r"restarted.*no_such_switch",
        ):
            gang.supervise(reports)
        assert gang.restarts == 0 and gang.restart_at is None
    finally:
        ray.get([actor.stop.remote(5) for actor in gang.actors], timeout=60)
        for actor in gang.actors:
            ray.kill(actor)
        ray.util.remove_placement_group(gang.group)
