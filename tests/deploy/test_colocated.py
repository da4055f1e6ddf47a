"""``placement: colocated`` rendered by ``python -m deploy.render``: one pod per node runs that node's trainer ranks
and rollout servers on the same GPUs. The node script is parsed back into each role's own argument parser."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from deploy import render
from protos.config import load_run_config

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[2]
BEAM = REPO_ROOT / "recipes" / "beam"
CLUSTER = ["--image", "registry.example/fleetrl:test", "--model-pvc", "models", "--run-pvc", "fleetrl-run"]


def render_objects(tmp_path: Path, recipe: Path, *extra: str) -> dict[tuple[str, str], dict]:
    assert render.main([str(recipe), *extra, *CLUSTER, "--out", str(tmp_path)]) == 0
    objects = {}
    for path in sorted(tmp_path.glob("*.yaml")):
        for obj in yaml.safe_load_all(path.read_text()):
            objects[(obj["kind"], obj["metadata"]["name"])] = obj
    return objects


def node_commands(script: str, node_rank: int, pod_ip: str = "10.0.0.1") -> tuple[list[dict], list[str]]:
    """What one node pod starts: (rollout servers with their env, the trainer argv), as kubelet and bash expand it."""
    pod = f"node-{node_rank}"
    text = script.replace("$(POD_NAME)", pod).replace("$(POD_IP)", pod_ip)
    servers, trainer, variables = [], [], {"NODE_RANK": str(node_rank)}
    for line in text.splitlines():
        if line.startswith("server=$(("):  # the shell arithmetic of this node's server index
            expression = line[len("server=$((") : -2].replace("NODE_RANK", str(node_rank)).replace("/", "//")
            variables["server"] = str(eval(expression))  # bash integer arithmetic
            continue
        condition = re.match(r"if \[ \$\(\((.*)\)\) -eq 0 \]; then (.*); fi", line)
        if condition:
            if eval(condition.group(1).replace("NODE_RANK", str(node_rank))) != 0:
                continue
            line = condition.group(2)
        for name, value in variables.items():
            line = line.replace("${" + name + "}", value)
        words = shlex.split(line.split(" & ")[0])
        if "rollout_service" in words:
            env = dict(word.split("=", 1) for word in words[: words.index("python")])
            servers.append({"env": env, "argv": words[words.index("rollout_service") + 1 :]})
        elif "trainer_service" in words:
            trainer = words
    return servers, trainer


def test_mxfp8_node_pods_run_a_trainer_node_and_its_replica_on_the_same_gpus(tmp_path):
    from coordinator.__main__ import parse_args as coordinator_args
    from rollout_service.__main__ import parse_args as rollout_args
    from trainer_service.__main__ import parse_args as trainer_args

    objects = render_objects(tmp_path, BEAM / "dapo-mxfp8.yaml")
    job = objects[("Job", "node")]
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["completions"] == 8
    main = job["spec"]["template"]["spec"]["containers"][0]
    assert main["resources"]["limits"]["nvidia.com/gpu"] == 8 and main["command"] == ["bash"]
    addresses = []
    for node_rank in range(8):
        servers, trainer = node_commands(main["args"][1], node_rank)
        assert len(servers) == 1 and servers[0]["env"]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
        served = rollout_args(servers[0]["argv"])
        assert served.server_id == f"rollout-{node_rank}" and served.host == f"node-{node_rank}.node"
        addresses.append(f"{served.host}:{served.port}")
        flags = dict(zip(trainer[3:13:2], trainer[4:14:2], strict=True))
        assert flags["--nnodes"] == "8" and flags["--nproc-per-node"] == "8"
        assert flags["--node-rank"] == str(node_rank) and flags["--rdzv-endpoint"] == "node-0.node:29400"
        parsed = trainer_args(trainer[trainer.index("trainer_service") + 1 :])
        assert parsed.overrides == ["weight_bus.host=10.0.0.1"]
    coordinator = coordinator_args(main_args(objects[("Job", "coordinator")]))
    assert coordinator.servers.split(",") == addresses
    config = load_run_config(BEAM / "dapo-mxfp8.yaml")
    assert config.weight_bus.transport == "ipc" and config.rollout.gpu_memory_utilization < 0.9


def main_args(workload: dict) -> list[str]:
    container = workload["spec"]["template"]["spec"]["containers"][0]
    args = [*container["command"], *container["args"]]
    return args[args.index("coordinator") + 1 :]


def test_a_replica_over_two_nodes_starts_on_its_first_node_only_with_the_flag(tmp_path):
    objects = render_objects(tmp_path, BEAM / "dapo-full-ft.yaml", "--allow-multi-node-rollout")
    script = objects[("Job", "node")]["spec"]["template"]["spec"]["containers"][0]["args"][1]
    started = {rank: node_commands(script, rank)[0] for rank in range(8)}
    assert [len(started[rank]) for rank in range(8)] == [1, 0, 1, 0, 1, 0, 1, 0]
    assert started[2][0]["env"]["CUDA_VISIBLE_DEVICES"] == ",".join(str(gpu) for gpu in range(16))
    assert "--server-id" in started[6][0]["argv"] and "rollout-3" in started[6][0]["argv"]
    assert "NOT STARTABLE" in objects[("Job", "node")]["metadata"]["annotations"]["fleetrl/multi-node-rollout"]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["rollout.num_servers=4"], "rollout.num_servers"),  # 32 rollout GPUs on 64 trainer GPUs
        (["weight_bus.transport=nccl"], "weight_bus.transport"),
        (["rollout.gpu_memory_utilization=0.9"], "rollout.gpu_memory_utilization"),
        (["trainer.num_processes=4", "trainer.num_nodes=16"], "trainer.num_processes"),  # a node has 8 GPUs
        (
            [  # 16 replicas of 3 GPUs on 6 nodes of 8: 48 GPUs either way, but a node cannot hold whole replicas
                "rollout.tensor_parallel_size=3",
                "rollout.num_servers=16",
                "trainer.num_nodes=6",
                "trainer.megatron.pipeline_model_parallel_size=4",
                "trainer.megatron.expert_model_parallel_size=4",
            ],
            "tile",
        ),
    ],
)
def test_a_layout_that_cannot_be_colocated_is_refused_naming_the_field(tmp_path, capsys, overrides, field):
    argv = [str(BEAM / "dapo-mxfp8.yaml"), *overrides, *CLUSTER, "--out", str(tmp_path / "out")]
    assert render.main(argv) == 2
    assert field in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_guides_env_variables_set_the_rendered_config(tmp_path, monkeypatch):
    monkeypatch.setenv("MAX_TRAINING_STEPS", "20")
    monkeypatch.setenv("CKPT_INTERVAL", "0")
    monkeypatch.setenv("EXPORT_PATH", "/fleetrl-run/exports/mine")
    objects = render_objects(tmp_path, BEAM / "dapo-lora-16.yaml", "num_steps=30", "--allow-multi-node-rollout")
    config = yaml.safe_load(objects[("ConfigMap", "fleetrl-config")]["data"]["config.json"])
    assert config["num_steps"] == 30  # the command line wins over the environment
    assert config["trainer"]["ckpt_interval"] == 0 and config["export_dir"] == "/fleetrl-run/exports/mine"
