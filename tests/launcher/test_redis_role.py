"""The embedded valkey as a supervised role (``fleetrl demo``): restarted on the same address after a crash, with
the run's streams, consumer groups and pending entries back from its append-only file."""

from __future__ import annotations

import os
import signal

import pytest
import redis

from launcher.redis_server import free_port, redis_spec, wait_accepting
from launcher.supervision import SupervisedProcess
from protos.config import RestartPolicy
from tests.waiting import wait_until

pytestmark = pytest.mark.integration


def test_a_killed_valkey_role_comes_back_on_its_address_with_every_acknowledged_write(tmp_path):
    port = free_port()
    spec = redis_spec(tmp_path / "valkey", "127.0.0.1", port)
    role = SupervisedProcess(lambda: spec, tmp_path / "logs", RestartPolicy(backoff_s=0.1))
    role.start()
    try:
        wait_accepting("127.0.0.1", port, 30.0)
        client = redis.Redis(port=port, socket_timeout=5)
        client.xgroup_create("trajectories", "trainer", id="0", mkstream=True)
        for index in range(3):
            client.xadd("trajectories", {"g": f"g{index}"})
        first = client.xreadgroup("trainer", "t0", {"trajectories": ">"}, count=2)[0][1]
        client.xack("trajectories", "trainer", first[0][0])  # one trained and acknowledged, one in flight
        os.killpg(role.pid, signal.SIGKILL)  # mid-run, as the chaos run killed it at step 40
        role.process.wait(timeout=30)
        wait_until(lambda: role.supervise() is not None and role.running, "valkey restarted by its supervisor", 30)
        wait_accepting("127.0.0.1", port, 30.0)
        assert role.restarts == 1
        pending = client.xpending_range("trajectories", "trainer", "-", "+", 10)
        assert [p["message_id"] for p in pending] == [first[1][0]]  # the in-flight entry, still pending
        rest = client.xreadgroup("trainer", "t0", {"trajectories": ">"})[0][1]
        assert [fields[b"g"] for _, fields in rest] == [b"g2"]  # nothing delivered twice, nothing lost
    finally:
        role.stop(grace_s=5)


def test_an_embedded_redis_that_cannot_start_ends_the_demo_with_its_log(tmp_path, monkeypatch):
    import socket

    from launcher import demo as launcher_module
    from launcher.demo import DemoLauncher
    from launcher.supervision import RoleFailed
    from protos.config import load_run_config

    with socket.socket() as taken:  # another server holds the port the launcher picked
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(launcher_module, "free_port", lambda host: taken.getsockname()[1])
        launcher = DemoLauncher(load_run_config(), tmp_path)
        try:
            with pytest.raises(RoleFailed, match=r"(?s)the embedded Redis did not start.*its log"):
                launcher.start_redis(timeout_s=30.0)
        finally:
            launcher.stop_all(grace_s=5)
    assert launcher.roles["valkey"].report()["state"] != "running"


def test_the_ray_role_actor_runs_valkey_in_a_directory_it_makes_and_restarts_it_with_its_data(tmp_path):
    """``fleetrl up``'s valkey: a RoleActor (plain class here, a Ray actor in a run) on a node where the run
    directory may not exist; a crash is restarted on the same address with every acknowledged write."""
    from launcher.ray_actors import RoleActor

    port = free_port()
    data_dir = tmp_path / "node" / "run" / "valkey"  # not made by the driver that built the spec
    policy = RestartPolicy(backoff_s=0.1).model_dump()
    actor = RoleActor(str(tmp_path / "logs"), policy, str(tmp_path), interval_s=0.05)
    pid = actor.start(redis_spec(data_dir, "127.0.0.1", port))
    try:
        wait_accepting("127.0.0.1", port, 30.0)
        assert (data_dir / "appendonlydir").is_dir()
        client = redis.Redis(port=port, socket_timeout=5)
        client.set("policy_version", 7)
        os.killpg(pid, signal.SIGKILL)

        def restarted() -> bool:
            report = actor.report()
            return report["restarts"] == 1 and report["state"] == "running" and report["pid"] != pid

        wait_until(restarted, "valkey restarted by its actor", 30)
        wait_accepting("127.0.0.1", port, 30.0)
        assert client.get("policy_version") == b"7"
    finally:
        actor.stop(grace_s=5)
