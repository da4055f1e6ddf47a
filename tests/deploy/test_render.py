"""``python -m deploy.render``: manifests for every recipe, parsed back and checked against the documented layouts
and against the roles' own argument parsers. Nothing here talks to a cluster."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deploy import render
from protos.config import RunConfig

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[2]
BEAM = REPO_ROOT / "recipes" / "beam"
DEMO_RECIPES = sorted((REPO_ROOT / "recipes").glob("demo-*.yaml"))
CLUSTER = ["--image", "registry.example/fleetrl:test", "--model-pvc", "models", "--run-pvc", "fleetrl-run"]
# (recipe, GPUs): the launch guide's GPU counts, trainer and vLLM colocated on them (recipes/beam/README.md).
BEAM_GPUS = [("dapo-lora-16.yaml", 16), ("dapo-lora-32.yaml", 32), ("dapo-full-ft.yaml", 64), ("dapo-mxfp8.yaml", 64)]
DISAGGREGATED = "placement=disaggregated"  # the same recipe with trainer and rollout pods of their own


def render_to(tmp_path: Path, recipe: Path, *extra: str) -> dict[tuple[str, str], dict]:
    """Render into tmp_path and parse every object back, keyed by (kind, name)."""
    argv = [str(recipe), *extra, *CLUSTER, "--out", str(tmp_path), "--allow-multi-node-rollout"]
    assert render.main(argv) == 0
    objects = {}
    for path in sorted(tmp_path.glob("*.yaml")):
        for obj in yaml.safe_load_all(path.read_text()):
            objects[(obj["kind"], obj["metadata"]["name"])] = obj
    return objects


def pod_gpus(workload: dict) -> tuple[int, int]:
    """(pods, GPUs per pod) of a StatefulSet or Job."""
    spec = workload["spec"]
    pods = spec["replicas"] if workload["kind"] == "StatefulSet" else spec["parallelism"]
    containers = spec["template"]["spec"]["containers"]
    return pods, sum(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0) for c in containers)


def main_args(workload: dict) -> list[str]:
    container = workload["spec"]["template"]["spec"]["containers"][0]
    return [*container["command"], *container["args"]]


def role_argv(args: list[str], module: str) -> list[str]:
    """What the role's own parser sees: the arguments after ``-m <module>``."""
    return args[args.index(module) + 1 :]


@pytest.mark.parametrize(("recipe", "gpus"), BEAM_GPUS)
def test_beam_recipes_render_the_guides_gpu_counts_colocated(tmp_path, capsys, recipe, gpus):
    objects = render_to(tmp_path, BEAM / recipe)
    pods, per_pod = pod_gpus(objects[("Job", "node")])
    assert pods * per_pod == gpus and per_pod == 8
    assert ("Job", "trainer") not in objects and ("StatefulSet", "rollout") not in objects
    assert f"total {gpus} GPUs" in capsys.readouterr().out
    assert pod_gpus(objects[("Job", "coordinator")])[1] == 0


@pytest.mark.parametrize(("recipe", "gpus"), BEAM_GPUS)
def test_beam_readme_table_matches_the_rendered_gpu_counts(tmp_path, recipe, gpus):
    objects = render_to(tmp_path, BEAM / recipe)
    pods, per_pod = pod_gpus(objects[("Job", "node")])
    row = next(line for line in (BEAM / "README.md").read_text().splitlines() if line.startswith(f"| `{recipe}`"))
    assert row.rstrip(" |").endswith(f"| {pods * per_pod}") and pods * per_pod == gpus


@pytest.mark.parametrize("recipe", DEMO_RECIPES, ids=lambda path: path.stem)
def test_demo_recipes_render_one_gpu_trainer_and_servers(tmp_path, recipe):
    objects = render_to(tmp_path, recipe, "model_path=/models/tiny")
    config = RunConfig.model_validate_json(objects[("ConfigMap", "fleetrl-config")]["data"]["config.json"])
    assert pod_gpus(objects[("Job", "trainer")]) == (1, 1)
    assert pod_gpus(objects[("StatefulSet", "rollout")]) == (config.rollout.num_servers, 1)
    assert main_args(objects[("Job", "trainer")])[:4] == ["python", "-m", "trainer_service", "train"]
    assert ("StatefulSet", "redis") in objects


def test_multi_node_trainer_runs_torchrun_with_the_node_layout(tmp_path):
    from trainer_service.__main__ import parse_args

    job = render_to(tmp_path, BEAM / "dapo-full-ft.yaml", DISAGGREGATED)[("Job", "trainer")]
    args = main_args(job)
    torchrun = args[: args.index("trainer_service")]
    assert torchrun[:3] == ["python", "-m", "trainer_service.torchrun"]
    flags = dict(zip(torchrun[3::2], torchrun[4::2], strict=False))
    assert flags["--nnodes"] == "8" and flags["--nproc-per-node"] == "8"
    assert flags["--rdzv-backend"] == "c10d" and flags["--rdzv-endpoint"] == "trainer-0.trainer:29400"
    assert flags["--node-rank"] == "$(NODE_RANK)"
    env = {
        e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
        for e in job["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["NODE_RANK"] == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["template"]["spec"]["subdomain"] == "trainer"
    parsed = parse_args(role_argv(args, "trainer_service"))
    assert (parsed.model, parsed.config) == ("/models/Beam-501B-A23B", "/etc/fleetrl/config.json")
    assert parsed.overrides == ["weight_bus.host=$(POD_IP)"]


def test_single_node_trainer_runs_torchrun_standalone(tmp_path):
    args = main_args(render_to(tmp_path, BEAM / "dapo.yaml", DISAGGREGATED)[("Job", "trainer")])
    assert args[:6] == ["python", "-m", "trainer_service.torchrun", "--standalone", "--nproc-per-node", "8"]
    assert "--nnodes" not in args and "--rdzv-endpoint" not in args


def test_coordinator_servers_are_the_rollout_pods_and_commands_parse(tmp_path):
    from coordinator.__main__ import parse_args as coordinator_args
    from rollout_service.__main__ import parse_args as rollout_args

    objects = render_to(tmp_path, BEAM / "dapo-mxfp8.yaml", DISAGGREGATED, "--data-pvc", "datasets")
    stateful_set = objects[("StatefulSet", "rollout")]
    assert objects[("Service", stateful_set["spec"]["serviceName"])]["spec"]["clusterIP"] == "None"
    served = rollout_args(role_argv(main_args(stateful_set), "rollout_service"))
    pods = [f"rollout-{i}" for i in range(stateful_set["spec"]["replicas"])]
    # Each server binds and reports $(POD_NAME).rollout:<port>; the coordinator must list exactly those addresses.
    reported = [f"{served.host.replace('$(POD_NAME)', pod)}:{served.port}" for pod in pods]
    assert reported == [f"{pod}.rollout:{served.port}" for pod in pods]
    coordinator = coordinator_args(role_argv(main_args(objects[("Job", "coordinator")]), "coordinator"))
    assert coordinator.servers.split(",") == reported
    assert served.server_id == "$(POD_NAME)" and served.redis_url == coordinator.redis_url == "redis://redis:6379/0"
    assert served.metrics_port == 9101 and served.config == coordinator.config == "/etc/fleetrl/config.json"
    probe = stateful_set["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    assert probe["grpc"]["port"] == served.port
    mounts = objects[("Job", "coordinator")]["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "data", "mountPath": "/opt/shared/data", "readOnly": True} in mounts


def test_every_pod_mounts_the_model_read_only_and_passes_it_as_model(tmp_path):
    objects = render_to(tmp_path, BEAM / "dapo-lora-16.yaml", DISAGGREGATED)
    for key in [("StatefulSet", "rollout"), ("Job", "trainer"), ("Job", "coordinator")]:
        spec = objects[key]["spec"]["template"]["spec"]
        mount = next(m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "model")
        assert mount == {"name": "model", "mountPath": "/models/Beam-501B-A23B", "readOnly": True}
        volume = next(v for v in spec["volumes"] if v["name"] == "model")
        assert volume["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
        args = main_args(objects[key])
        assert args[args.index("--model") + 1] == "/models/Beam-501B-A23B"


def test_configmap_holds_a_config_that_revalidates_with_cluster_settings(tmp_path):
    objects = render_to(tmp_path, BEAM / "dapo-full-ft.yaml", "trainer.lr=2e-6")
    config = RunConfig.model_validate_json(objects[("ConfigMap", "fleetrl-config")]["data"]["config.json"])
    assert config.trainer.lr == 2e-6 and config.trainer.num_nodes == 8
    assert config.redis_url == "redis://redis:6379/0" and config.out_dir == "/fleetrl-run/beam-dapo-full-ft"
    # the guide's home-relative paths land on the shared run volume, where every pod sees them
    assert config.trainer.ckpt_dir == "/fleetrl-run/ckpts/{run_id}"
    assert config.export_path().as_posix() == "/fleetrl-run/exports/beam-dapo-full-ft"
    assert config.coordinator.admin_host == "0.0.0.0" and config.coordinator.admin_port == 50050
    service_ports = {p["name"]: p["port"] for p in objects[("Service", "coordinator")]["spec"]["ports"]}
    assert service_ports == {"admin": 50050, "metrics": 9100, "dashboard": config.coordinator.dashboard_port}


def test_redis_url_in_the_config_is_used_instead_of_a_redis_pod(tmp_path):
    objects = render_to(tmp_path, BEAM / "dapo-mxfp8.yaml", "redis_url=redis://shared-redis:6379/3")
    assert ("StatefulSet", "redis") not in objects
    args = main_args(objects[("Job", "coordinator")])
    assert args[args.index("--redis-url") + 1] == "redis://shared-redis:6379/3"


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("trainer.num_procesess=8", "num_procesess"),  # misspelt key: pydantic names it
        ("trainer.num_processes=16", "trainer.num_processes"),  # more ranks than one node has GPUs
        ("trainer.ckpt_dir=/tmp/ckpt", "trainer.ckpt_dir"),  # not on the shared volume
        ("model_path=", "model_path"),
    ],
)
def test_bad_override_fails_naming_the_field(tmp_path, capsys, override, field):
    argv = [str(BEAM / "dapo-mxfp8.yaml"), override, *CLUSTER, "--out", str(tmp_path / "out")]
    assert render.main(argv) == 2
    assert field in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_rollout_replica_larger_than_a_node_is_refused_without_the_flag(tmp_path, capsys):
    argv = [str(BEAM / "dapo-full-ft.yaml"), *CLUSTER, "--out", str(tmp_path / "out")]
    assert render.main(argv) == 2
    error = capsys.readouterr().err
    assert "rollout.pipeline_parallel_size" in error and "--allow-multi-node-rollout" in error
    assert not (tmp_path / "out").exists()
    objects = render_to(tmp_path / "allowed", BEAM / "dapo-full-ft.yaml")
    assert "fleetrl/multi-node-rollout" in objects[("Job", "node")]["metadata"]["annotations"]


def test_deploy_imports_only_protos():
    allowed_project = {"deploy", "protos"}
    project = set("protos weight_bus rollout_service trainer_service coordinator modeling deploy launcher".split())
    for path in (REPO_ROOT / "deploy").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            for name in names:
                top = name.split(".")[0]
                assert top not in project or top in allowed_project, f"{path.name} imports {name}"


def test_wait_for_rollout_init_script_waits_for_grpc_health(tmp_path):
    """The coordinator's init container script against a real gRPC health server (and a closed port)."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from deploy.commands import WAIT_FOR_ROLLOUT

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        ready = subprocess.run(
            [sys.executable, "-c", WAIT_FOR_ROLLOUT, f"127.0.0.1:{port}", "30"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert ready.returncode == 0, ready.stderr
    finally:
        server.stop(0)
    closed = subprocess.run(
        [sys.executable, "-c", WAIT_FOR_ROLLOUT, f"127.0.0.1:{port}", "0"], capture_output=True, text=True, timeout=30
    )
    assert closed.returncode != 0 and "not SERVING" in closed.stderr
