"""``python -m deploy.render --kuberay``: a RayCluster sized from the recipe and a RayJob running ``fleetrl up``; and
every recipe's manifests, plain and KubeRay, valid under the vendored Kubernetes and KubeRay schemas
(``python -m deploy.validate``). Nothing here talks to a cluster."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from deploy import render, validate
from protos.config import RunConfig, load_run_config

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO_ROOT / "recipes").glob("*.yaml")) + sorted((REPO_ROOT / "recipes" / "beam").glob("*.yaml"))
CLUSTER = ["--image", "registry.example/fleetrl:test", "--model-pvc", "models", "--run-pvc", "fleetrl-run"]
# (recipe, rollout replicas x hosts x GPUs, trainer pods x GPUs): recipes/beam/README.md's layouts on 8-GPU nodes,
# disaggregated (KubeRay renders trainer and rollout groups of their own; the recipes colocate them)
BEAM_RAY_GROUPS = [
    ("dapo-full-ft.yaml", (4, 2, 8), (8, 8)),
    ("dapo-mxfp8.yaml", (8, 1, 8), (8, 8)),
    ("dapo-lora-16.yaml", (1, 2, 8), (2, 8)),
    ("dapo-lora-32.yaml", (2, 2, 8), (4, 8)),
]
DISAGGREGATED = "placement=disaggregated"


def recipe_overrides(recipe: Path) -> list[str]:
    """The demo recipes build their tiny model on the fly (model_path ''): on a cluster it comes from a volume."""
    return [] if load_run_config(str(recipe), []).model_path else ["model_path=/models/tiny"]


def kuberay_overrides(recipe: Path) -> list[str]:
    """--kuberay renders disaggregated runs: a colocated recipe (the Beam runs) as trainer and rollout groups."""
    return [DISAGGREGATED] if load_run_config(str(recipe), []).placement == "colocated" else []


def render_to(out: Path, recipe: Path, *extra: str) -> dict[tuple[str, str], dict]:
    argv = [str(recipe), *recipe_overrides(recipe), *extra, *CLUSTER, "--out", str(out)]
    assert render.main(argv) == 0
    return {
        (obj["kind"], obj["metadata"]["name"]): obj
        for path in sorted(out.glob("*.yaml"))
        for obj in yaml.safe_load_all(path.read_text())
    }


def worker_groups(objects: dict) -> dict[str, dict]:
    (cluster,) = [obj for (kind, _), obj in objects.items() if kind == "RayCluster"]
    return {group["groupName"]: group for group in cluster["spec"]["workerGroupSpecs"]}


def group_gpus(group: dict) -> int:
    return group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda path: f"{path.parent.name}/{path.stem}")
@pytest.mark.parametrize("kind", ["plain", "kuberay"])
def test_every_recipe_renders_manifests_valid_under_the_kubernetes_and_kuberay_schemas(tmp_path, recipe, kind):
    extra = [*kuberay_overrides(recipe), "--kuberay"] if kind == "kuberay" else ["--allow-multi-node-rollout"]
    objects = render_to(tmp_path, recipe, *extra)
    kinds = {kind for kind, _ in objects}
    assert {"RayCluster", "RayJob"} <= kinds if kind == "kuberay" else {"StatefulSet", "Job"} <= kinds
    assert validate.main([str(tmp_path)]) == 0
    for path in tmp_path.glob("*.yaml"):
        checked, errors = validate.file_errors(path)
        assert checked and errors == [], errors


@pytest.mark.parametrize(("recipe", "rollout", "trainer"), BEAM_RAY_GROUPS)
def test_worker_groups_are_sized_from_replicas_tp_pp_and_trainer_ranks(tmp_path, capsys, recipe, rollout, trainer):
    path = REPO_ROOT / "recipes" / "beam" / recipe
    plain = render_to(tmp_path / "plain", path, DISAGGREGATED, "--allow-multi-node-rollout")
    groups = worker_groups(render_to(tmp_path / "ray", path, DISAGGREGATED, "--kuberay"))
    assert (groups["rollout"]["replicas"], groups["rollout"]["numOfHosts"], group_gpus(groups["rollout"])) == rollout
    assert (groups["trainer"]["replicas"], group_gpus(groups["trainer"])) == trainer
    # the same GPUs as the plain manifests (one pod per replica there, whole-node pods here)
    stateful_set, job = plain[("StatefulSet", "rollout")], plain[("Job", "trainer")]
    plain_gpus = [
        stateful_set["spec"]["replicas"]
        * stateful_set["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"],
        job["spec"]["parallelism"]
        * job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"],
    ]
    assert [rollout[0] * rollout[1] * rollout[2], trainer[0] * trainer[1]] == plain_gpus
    (summary,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("run ")][-1:]
    assert f"total {sum(plain_gpus)} GPUs" in summary
    for role, group in groups.items():
        assert group["resources"] == {"GPU": str(group_gpus(group)), f"fleetrl_{role}": str(group_gpus(group))}
        assert group["minReplicas"] == group["maxReplicas"] == group["replicas"]


def test_small_replicas_share_a_pod_and_the_head_has_no_gpu(tmp_path):
    objects = render_to(tmp_path, REPO_ROOT / "recipes" / "demo-echo.yaml", "rollout.num_servers=3", "--kuberay")
    groups = worker_groups(objects)
    assert (groups["rollout"]["replicas"], groups["rollout"]["numOfHosts"], group_gpus(groups["rollout"])) == (1, 1, 3)
    cluster = next(obj for (kind, _), obj in objects.items() if kind == "RayCluster")
    head = cluster["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0" and "resources" not in head["template"]["spec"]["containers"][0]
    assert head["resources"] == {"fleetrl_coordinator": "1"}
    ports = {p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert ports["dashboard"] == 8265 and ports["fleetrl-admin"] == 50050 and ports["metrics"] == 9100


def test_the_rayjob_runs_fleetrl_up_on_the_cluster_with_the_recipe_from_the_configmap(tmp_path):
    recipe = REPO_ROOT / "recipes" / "beam" / "dapo-mxfp8.yaml"
    objects = render_to(tmp_path, recipe, "trainer.lr=2e-6", DISAGGREGATED, "--kuberay")
    (job,) = [obj for (kind, _), obj in objects.items() if kind == "RayJob"]
    (cluster_name,) = [name for kind, name in objects if kind == "RayCluster"]
    assert job["spec"]["entrypoint"] == "fleetrl up /etc/fleetrl/recipe.yaml --ray auto"
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster_name}
    data = objects[("ConfigMap", "fleetrl-config")]["data"]
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(data["recipe.yaml"])
    from_recipe = load_run_config(str(recipe), [])
    assert from_recipe == RunConfig.model_validate_json(data["config.json"]) and from_recipe.trainer.lr == 2e-6
    cluster = objects[("RayCluster", cluster_name)]["spec"]
    pods = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    for pod in pods:
        mounts = pod["spec"]["containers"][0]["volumeMounts"]
        assert {"name": "config", "mountPath": "/etc/fleetrl", "readOnly": True} in mounts
        assert {"name": "dshm", "mountPath": "/dev/shm"} in mounts


def test_a_tensor_parallel_group_larger_than_a_node_is_refused_naming_the_field(tmp_path, capsys):
    recipe = REPO_ROOT / "recipes" / "beam" / "dapo-mxfp8.yaml"
    argv = [
        str(recipe),
        "rollout.tensor_parallel_size=16",
        DISAGGREGATED,
        *CLUSTER,
        "--out",
        str(tmp_path),
        "--kuberay",
    ]
    assert render.main(argv) == 2
    assert "rollout.tensor_parallel_size=16 exceeds the 8 GPUs of one node" in capsys.readouterr().err


def test_the_validator_names_the_file_object_and_field_of_each_error(tmp_path, capsys):
    render_to(tmp_path, REPO_ROOT / "recipes" / "demo-echo.yaml", "--kuberay")
    path = tmp_path / "50-raycluster.yaml"
    cluster = yaml.safe_load(path.read_text())
    cluster["spec"]["workerGroupSpecs"][0]["replicas"] = "two"
    cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    cluster["spec"]["autoscaling"] = True
    path.write_text(yaml.safe_dump(cluster))
    (tmp_path / "70-pod.yaml").write_text(json.dumps({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}}))
    assert validate.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    prefix = f"{path}: RayCluster/fleetrl-demo: "
    assert prefix + "spec: Additional properties are not allowed ('autoscaling' was unexpected)" in out
    assert prefix + "spec.workerGroupSpecs.0.replicas: 'two' is not of type 'integer'" in out
    assert "spec.headGroupSpec.template.spec.containers.0: Additional properties are not allowed" in out
    assert "70-pod.yaml: Pod/x: apiVersion 'v1' kind 'Pod' is not a kind this renderer writes" in out
    assert out.strip().endswith("4 errors (Kubernetes v1.33.0, KubeRay ray.io/v1)")
