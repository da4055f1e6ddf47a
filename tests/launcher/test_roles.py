"""What both launchers build from a config: role specs, a trainer gang's torchrun environment, the Ray bundles and
the layouts fleetrl up refuses, and the RunControl mailbox of fleetrl down|scale."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher import roles
from launcher.ray_actors import RunControl
from launcher.ray_control import serving_replicas
from launcher.ray_placement import (
    actor_options,
    check_placeable,
    coordinator_resources,
    resolve_cluster_choices,
    rollout_bundle,
    trainer_bundles,
    trainer_rank_resources,
)
from launcher.supervision import RoleFailed
from protos.config import load_run_config

pytestmark = pytest.mark.unit

CONFIG = Path("/run/config.json")


def test_the_coordinator_finds_servers_by_discovery_or_is_handed_the_list():
    found = roles.coordinator_spec(load_run_config(), CONFIG, ["h:1", "h:2"], ("coordinator.admin_host=10.0.0.5",))
    assert "--servers" not in found.argv and found.argv[-1] == "coordinator.admin_host=10.0.0.5"
    listed = roles.coordinator_spec(load_run_config(overrides=["coordinator.discovery=false"]), CONFIG, ["h:1", "h:2"])
    assert listed.argv[listed.argv.index("--servers") + 1] == "h:1,h:2"
    assert not found.serves_until_stopped


def test_rollout_specs_take_a_free_or_a_fixed_port_and_write_their_address(tmp_path):
    free = roles.rollout_spec(load_run_config(), CONFIG, tmp_path, 3, host="10.0.0.7")
    argv = free.argv
    assert free.name == "rollout-3" and free.serves_until_stopped
    assert argv[argv.index("--port") + 1] == "0" and argv[argv.index("--server-id") + 1] == "rollout-3"
    assert argv[argv.index("--host") + 1] == "10.0.0.7" and free.address_file == str(tmp_path / "rollout-3.address")
    fixed = roles.rollout_spec(load_run_config(overrides=["rollout.base_port=51000"]), CONFIG, tmp_path, 3)
    assert fixed.argv[fixed.argv.index("--port") + 1] == "51003" and "--host" not in fixed.argv


def test_a_gang_over_two_nodes_gets_torchruns_environment_with_each_nodes_gpus():
    envs = roles.rank_environments(["n1", "n1", "n2", "n2"], [["3"], ["5"], ["0"], ["1"]], "10.0.0.1", 29500)
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"] and {e["WORLD_SIZE"] for e in envs} == {"4"}
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "0", "1"]
    assert [e["GROUP_RANK"] for e in envs] == ["0", "0", "1", "1"]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["3,5", "3,5", "0,1", "0,1"]  # LOCAL_RANK indexes its own
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"], e["LOCAL_WORLD_SIZE"]) for e in envs} == {("10.0.0.1", "29500", "2")}
    cpu = roles.rank_environments(["n1"], [[]], "127.0.0.1", 29501)[0]
    assert "CUDA_VISIBLE_DEVICES" not in cpu
    assert roles.trainer_rank_spec(CONFIG, cpu).name == "trainer"
    rank = roles.trainer_rank_spec(CONFIG, envs[2], ("weight_bus.host=10.0.0.1",))
    assert rank.name == "trainer-rank-2" and rank.env["RANK"] == "2" and rank.argv[-1] == "weight_bus.host=10.0.0.1"
    assert rank.argv[:3] == ("-m", "trainer_service", "train")


def test_bundles_ask_for_cpus_only_unless_the_recipe_uses_gpus():
    cpu = load_run_config("recipes/demo-echo.yaml", ["launcher.ray.use_gpus=false"])
    assert rollout_bundle(cpu) == {"CPU": 1.0}
    assert trainer_bundles(cpu) == ([{"CPU": 1.0}], "STRICT_PACK")
    gpu = load_run_config(
        overrides=[
            "launcher.ray.use_gpus=true",
            "rollout.tensor_parallel_size=4",
            "rollout.pipeline_parallel_size=2",
            "trainer.backend=megatron",
            "trainer.num_nodes=2",
            "trainer.num_processes=8",
        ]
    )
    assert rollout_bundle(gpu) == {"CPU": 1.0, "GPU": 8}  # TP x PP in one bundle: one node
    assert trainer_bundles(gpu) == ([{"CPU": 8.0, "GPU": 8}] * 2, "STRICT_SPREAD")  # a bundle per trainer node


def test_gpus_and_kuberays_role_resources_follow_the_cluster_unless_the_recipe_says():
    cpu_box, kuberay = {"CPU": 8.0}, {"CPU": 64.0, "GPU": 16.0}
    kuberay.update(fleetrl_rollout=8.0, fleetrl_trainer=8.0, fleetrl_coordinator=1.0)
    config = load_run_config(overrides=["rollout.tensor_parallel_size=8", "trainer.backend=megatron"])
    resolve_cluster_choices(config, cpu_box)
    assert (config.launcher.ray.use_gpus, config.launcher.ray.role_resources) == (False, False)
    assert rollout_bundle(config) == {"CPU": 1.0}
    config = load_run_config(
        overrides=["rollout.tensor_parallel_size=8", "trainer.backend=megatron", "trainer.num_processes=8"]
    )
    resolve_cluster_choices(config, kuberay)
    assert rollout_bundle(config) == {"CPU": 1.0, "GPU": 8, "fleetrl_rollout": 8}
    assert trainer_bundles(config)[0] == [{"CPU": 8.0, "GPU": 8, "fleetrl_trainer": 8}]
    assert trainer_rank_resources(config) == {"CPU": 1.0, "GPU": 1, "fleetrl_trainer": 1}
    assert coordinator_resources(config) == {"CPU": 1.0, "fleetrl_coordinator": 1}
    assert actor_options(rollout_bundle(config)) == {
        "num_cpus": 1.0,
        "num_gpus": 8,
        "resources": {"fleetrl_rollout": 8},
    }
    kept = load_run_config(overrides=["launcher.ray.use_gpus=false", "launcher.ray.role_resources=false"])
    resolve_cluster_choices(kept, kuberay)
    assert (kept.launcher.ray.use_gpus, kept.launcher.ray.role_resources) == (False, False)


@pytest.mark.parametrize(
    ("overrides", "local", "needle"),
    [
        (["launcher.ray.use_gpus=true", "weight_bus.transport=ipc"], False, "transport='ipc' shares one GPU"),
        (["weight_bus.transport=nccl"], False, "set launcher.ray.use_gpus=true"),
        (["trainer.backend=megatron", "trainer.num_nodes=2"], True, "trainer.num_nodes=2 on a local Ray cluster"),
        (["agent.enabled=true", "agent.demo_agents=2"], True, "fleetrl up starts no example agents"),
    ],
)
def test_layouts_fleetrl_up_cannot_place_are_refused_naming_the_field(overrides, local, needle):
    with pytest.raises(RoleFailed, match=needle.replace("(", r"\(").replace(")", r"\)")):
        check_placeable(load_run_config(overrides=overrides), local)
    check_placeable(load_run_config("recipes/demo-echo.yaml"), local=True)


def test_run_control_hands_requests_to_the_driver_once_and_refuses_what_cannot_scale():
    control = RunControl("r1", "/runs/r1")
    with pytest.raises(ValueError, match=r"cannot scale 'trainer': only rollout scales"):
        control.request_scale("trainer", 2)
    with pytest.raises(ValueError, match=r"rollout=0: a run needs at least one rollout replica"):
        control.request_scale("rollout", 0)
    control.request_scale("rollout", 3)
    assert control.take_requests() == ("", {"rollout": 3}) and control.take_requests() == ("", {})
    control.request_stop("fleetrl down")
    assert control.take_requests() == ("fleetrl down", {})


def test_scale_waits_for_serving_replicas_and_none_leaving():
    serving = {"kind": "rollout", "state": "running", "address": "h:1"}
    report = {"roles": {"rollout-0": serving, "rollout-1": {**serving, "address": None}, "trainer": {"kind": "x"}}}
    assert serving_replicas(report, "rollout") == 1
    report["roles"]["rollout-2"] = {"kind": "rollout", "state": "leaving", "leaving": True}
    assert serving_replicas(report, "rollout") == -1


def test_a_heartbeat_timeout_shorter_than_two_beats_is_refused():
    with pytest.raises(ValueError, match=r"coordinator.server_timeout_s \(1.5\) must be at least twice"):
        load_run_config(overrides=["coordinator.server_timeout_s=1.5"])
    load_run_config(overrides=["coordinator.server_timeout_s=1.5", "rollout.heartbeat_interval_s=0.5"])
