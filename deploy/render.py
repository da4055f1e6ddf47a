"""``python -m deploy.render RECIPE.yaml [dotted.overrides ...] --image IMAGE --model-pvc NAME --run-pvc NAME --out DIR``

Writes plain Kubernetes YAML for one run (``kubectl apply -f DIR``): the resolved config as a ConfigMap, Redis
(unless the config sets ``redis_url``), the rollout servers, the trainer and the coordinator, then prints the pods
and GPUs per role. With ``--kuberay`` it writes a KubeRay RayCluster and a RayJob (``fleetrl up``) in place of the
three role workloads (deploy/kuberay.py). ``python -m deploy.validate DIR`` checks the result against the schemas. The config goes through ``protos.config.load_run_config`` like everywhere else, so overrides and
validation errors are the same as for ``fleetrl demo``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import yaml

from deploy import colocated, kuberay, layout, manifests
from deploy.k8s import Manifest, RenderOptions
from protos.config import RunConfig, load_run_config


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.render", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config", help="run config (YAML/JSON), e.g. recipes/beam/dapo-full-ft.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.num_servers=2")
    parser.add_argument("--image", required=True, help="the fleetrl image (deploy/Dockerfile)")
    parser.add_argument("--model-pvc", required=True, help="PVC holding the model; mounted read-only at model_path")
    parser.add_argument("--model-subpath", default="", help="directory inside --model-pvc (default: its root)")
    parser.add_argument(
        "--run-pvc",
        required=True,
        help=f"ReadWriteMany PVC mounted at {layout.RUN_VOLUME_PATH}: out_dir, checkpoints, snapshots",
    )
    parser.add_argument("--data-pvc", default="", help="PVC holding the coordinator's dataset files (read-only)")
    parser.add_argument("--out", required=True, help="directory the manifests are written to")
    parser.add_argument("--redis-image", default=RenderOptions.redis_image)
    parser.add_argument("--redis-storage", default=RenderOptions.redis_storage, help="Redis volume size")
    parser.add_argument("--gpus-per-node", type=int, default=RenderOptions.gpus_per_node)
    parser.add_argument(
        "--allow-multi-node-rollout",
        action="store_true",
        help="render rollout replicas larger than a node (they need Ray, which is not rendered)",
    )
    parser.add_argument(
        "--workdir",
        default=RenderOptions.workdir,
        help="the image's working directory; relative dataset paths resolve against it",
    )
    parser.add_argument(
        "--kuberay",
        action="store_true",
        help="render a KubeRay RayCluster and a RayJob running `fleetrl up` instead of the plain role workloads",
    )
    parser.add_argument("--ray-version", default=RenderOptions.ray_version, help="the image's Ray (rayVersion)")
    parser.add_argument(
        "--backoff-limit",
        type=int,
        default=RenderOptions.backoff_limit,
        help="restarts of the trainer and coordinator Jobs before they count as failed",
    )
    return parser.parse_intermixed_args(argv)


def load_for_cluster(config_path: str, overrides: list[str]) -> tuple[RunConfig, bool]:
    """The run config with the guide's environment variables (``ENV_ALIASES``), the user's overrides and the
    cluster settings it leaves at laptop defaults, and whether Redis must be rendered (the config sets no
    ``redis_url``)."""
    config = load_run_config(config_path, overrides, environ=os.environ)
    render_redis = not config.redis_url
    cluster = load_run_config(config_path, [*overrides, *layout.cluster_overrides(config)], environ=os.environ)
    layout.check_paths(cluster)
    return cluster, render_redis


def build(
    config: RunConfig, options: RenderOptions, render_redis: bool
) -> tuple[list[Manifest], list[layout.RolePods]]:
    """Every manifest of the run and the GPU pods per role; raises LayoutError for a layout that cannot run."""
    if config.placement == "colocated":
        if options.kuberay:
            raise layout.LayoutError(
                "placement='colocated' renders node pods of its own; --kuberay renders disaggregated runs (add "
                "placement=disaggregated, or drop --kuberay)"
            )
        return build_colocated(config, options, render_redis)
    rendered = [manifests.config_map(config)]
    if render_redis:
        rendered.append(manifests.redis(config, options))
    if options.kuberay:
        groups = [
            kuberay.rollout_group(config, options.gpus_per_node),
            kuberay.trainer_group(config, options.gpus_per_node),
        ]
        rendered += [kuberay.ray_cluster(config, options, groups), kuberay.ray_job(config, options)]
        return rendered, [layout.RolePods(g.role, g.num_pods, g.gpus_per_pod) for g in groups]
    trainer_pods = layout.trainer_pods(config, options.gpus_per_node)
    rollout_pods = layout.rollout_pods(config, options.gpus_per_node, options.allow_multi_node_rollout)
    rendered += [
        manifests.rollout(config, options, rollout_pods),
        manifests.trainer(config, options, trainer_pods),
        manifests.coordinator(config, options),
    ]
    return rendered, [trainer_pods, rollout_pods]


def build_colocated(
    config: RunConfig, options: RenderOptions, render_redis: bool
) -> tuple[list[Manifest], list[layout.RolePods]]:
    """``placement: colocated``: one pod per node runs that node's trainer ranks and rollout servers."""
    nodes = colocated.node_layout(config, options.gpus_per_node, options.allow_multi_node_rollout)
    rendered = [manifests.config_map(config)]
    if render_redis:
        rendered.append(manifests.redis(config, options))
    rendered += [
        colocated.node_manifest(config, options, nodes),
        manifests.coordinator(config, options, colocated.rollout_addresses(config, nodes)),
    ]
    return rendered, [colocated.node_pods(config, nodes)]


class _ReadableDumper(yaml.SafeDumper):
    """``yaml.SafeDumper`` that writes multi-line text (the ConfigMap's JSON) as a literal block."""


def _represent_text(dumper: yaml.SafeDumper, text: str) -> yaml.Node:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_ReadableDumper.add_representer(str, _represent_text)


def write(rendered: list[Manifest], out_dir: Path, source: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for manifest in rendered:
        header = [
            f"Rendered by python -m deploy.render from {source}; edit the recipe and re-render, not this file.",
            *manifest.comment,
        ]
        text = "".join(f"# {line}\n" for line in header)
        text += yaml.dump_all(manifest.objects, Dumper=_ReadableDumper, sort_keys=False, width=120)
        path = out_dir / manifest.filename
        path.write_text(text)
        written.append(path)
    return written


def notes(config: RunConfig, options: RenderOptions) -> list[str]:
    """What the summary must point out: things this renderer cannot check from here."""
    lines = []
    datasets = layout.dataset_paths(config, options.workdir)
    if datasets and not options.data_pvc:
        lines.append(
            f"note: the coordinator reads {', '.join(datasets)}; no --data-pvc given, so the image must contain them"
        )
    if layout.rollout_spans_nodes(config, options.gpus_per_node) and not options.kuberay:
        manifest = "30-node.yaml" if config.placement == "colocated" else "20-rollout.yaml"
        lines.append(
            f"note: rollout replicas span nodes (see {manifest}): they will not start until multi-node vLLM (Ray) "
            "is built"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    options = RenderOptions(
        image=args.image,
        model_pvc=args.model_pvc,
        run_pvc=args.run_pvc,
        model_subpath=args.model_subpath,
        data_pvc=args.data_pvc,
        redis_image=args.redis_image,
        redis_storage=args.redis_storage,
        gpus_per_node=args.gpus_per_node,
        allow_multi_node_rollout=args.allow_multi_node_rollout,
        workdir=args.workdir,
        backoff_limit=args.backoff_limit,
        kuberay=args.kuberay,
        ray_version=args.ray_version,
    )
    try:
        config, render_redis = load_for_cluster(args.config, args.overrides)
        rendered, pods = build(config, options, render_redis)
    except ValueError as error:  # pydantic's ValidationError and LayoutError both name the field
        print(f"deploy.render: invalid config: {error}", file=sys.stderr)
        return 2
    for path in write(rendered, Path(args.out), args.config):
        print(f"wrote {path}")
    cpu_roles = ["ray head (coordinator)" if options.kuberay else "coordinator"] + (["redis"] if render_redis else [])
    print(f"run {config.run_id}: {layout.summary(pods, cpu_roles)}")
    for line in notes(config, options):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
