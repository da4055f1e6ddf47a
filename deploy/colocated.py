"""Colocated runs (``placement: colocated``) on Kubernetes: one pod per node holds that node's GPUs for both roles.

Each node pod (an Indexed Job ``node``, pod i is ``node-i.node``) runs the trainer's torchrun for node rank i and the
rollout servers whose GPUs are on that node, all on the same ``--gpus-per-node`` GPUs: the engine takes
``rollout.gpu_memory_utilization`` of each, the trainer ranks the rest, and rank 0 hands its weights to the engines
of its node in memory (``weight_bus.transport`` 'ipc'; servers on other nodes fetch them over tcp). The pod lives
as long as its trainer: when torchrun exits, the script stops the node's servers and exits with torchrun's code.

A rollout replica larger than a node (TP x PP above ``--gpus-per-node``, as the guide's TP8 x PP2) would need vLLM
across the node pods (Ray); ``rollout_service`` does not start that, so such a layout is refused unless
``--allow-multi-node-rollout``: then the first node of each replica starts its server asking for every GPU of the
replica, which cannot start on one node (the manifest says so).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from deploy import layout
from deploy.commands import trainer_role_args
from deploy.k8s import (
    CONFIG_PATH,
    Manifest,
    RenderOptions,
    config_volume,
    container,
    field_env,
    gpu_limits,
    headless_service,
    labels,
    metadata,
    model_volume,
    run_volume,
    scrape_annotations,
    shm_volume,
)
from protos.config import RunConfig
from protos.trainer_command import Rendezvous, trainer_argv

NODE_SERVICE = "node"  # headless Service: node pods are node-<i>.node
ROLE = "node"


@dataclass(frozen=True)
class NodeLayout:
    """Which rollout servers each node pod runs: server ``s`` lives on node ``s // servers_per_node`` (one-node
    replicas), or is started on the first of its ``nodes_per_replica`` nodes (replicas larger than a node)."""

    num_nodes: int
    gpus_per_node: int
    gpus_per_replica: int
    servers_per_node: int  # 0 on nodes that only hold later shards of a multi-node replica
    nodes_per_replica: int

    def servers_on(self, node: int) -> list[int]:
        if self.nodes_per_replica > 1:
            return [node // self.nodes_per_replica] if node % self.nodes_per_replica == 0 else []
        return list(range(node * self.servers_per_node, (node + 1) * self.servers_per_node))

    @property
    def spans_nodes(self) -> bool:
        return self.nodes_per_replica > 1


def node_layout(config: RunConfig, gpus_per_node: int, allow_multi_node: bool) -> NodeLayout:
    """The node pods of a colocated run; raises LayoutError (naming the field) for one that cannot be colocated."""
    trainer, rollout = config.trainer, config.rollout
    if trainer.num_processes != gpus_per_node:
        raise layout.LayoutError(
            f"placement='colocated': a node pod holds one node's {gpus_per_node} GPUs (--gpus-per-node) for both "
            f"roles, so trainer.num_processes must be {gpus_per_node} (got {trainer.num_processes})"
        )
    gpus = layout.rollout_gpus_per_replica(config)
    if gpus <= gpus_per_node:
        if gpus_per_node % gpus:
            raise layout.LayoutError(
                f"placement='colocated': a replica of rollout.tensor_parallel_size x pipeline_parallel_size = {gpus} "
                f"GPUs does not tile a node's {gpus_per_node} GPUs; pick a divisor of {gpus_per_node}"
            )
        return NodeLayout(trainer.num_nodes, gpus_per_node, gpus, gpus_per_node // gpus, 1)
    if gpus % gpus_per_node:
        raise layout.LayoutError(
            f"placement='colocated': a replica of {gpus} GPUs (rollout.tensor_parallel_size x pipeline_parallel_size) "
            f"must span whole nodes of {gpus_per_node} GPUs"
        )
    if not allow_multi_node:
        raise layout.LayoutError(
            f"placement='colocated': a rollout replica of rollout.tensor_parallel_size x pipeline_parallel_size = "
            f"{rollout.tensor_parallel_size} x {rollout.pipeline_parallel_size} = {gpus} GPUs spans "
            f"{gpus // gpus_per_node} node pods; vLLM across pods needs a Ray cluster per replica, which "
            "rollout_service does not start. Lower rollout.pipeline_parallel_size (and raise rollout.num_servers), "
            "or pass --allow-multi-node-rollout to render it anyway (its servers cannot start)"
        )
    return NodeLayout(trainer.num_nodes, gpus_per_node, gpus, 0, gpus // gpus_per_node)


def server_port(config: RunConfig, slot: int) -> int:
    """The gRPC port of the ``slot``-th server of a node pod (servers of one pod share its address)."""
    return config.rollout.base_port + slot


def rollout_addresses(config: RunConfig, nodes: NodeLayout) -> list[str]:
    """The coordinator's --servers: each server's node pod and port, in server order."""
    addresses = []
    for node in range(nodes.num_nodes):
        for slot, _server in enumerate(nodes.servers_on(node)):
            addresses.append(f"{NODE_SERVICE}-{node}.{NODE_SERVICE}:{server_port(config, slot)}")
    return addresses


def _shell_word(part: str) -> str:
    """One argv word for bash: shell variables (``${...}``) expand inside double quotes, the rest is quoted."""
    return f'"{part}"' if "${" in part else shlex.quote(part)


def node_script(config: RunConfig, nodes: NodeLayout) -> str:
    """The node pod's shell script: this node's rollout servers in the background, torchrun in the foreground."""
    lines = ["set -u", "servers=()"]
    for slot in range(max((len(nodes.servers_on(node)) for node in range(nodes.num_nodes)), default=0)):
        first_gpu = slot * nodes.gpus_per_replica
        devices = ",".join(str(gpu) for gpu in range(first_gpu, first_gpu + nodes.gpus_per_replica))
        argv = [
            "python", "-m", "rollout_service", "serve", "--model", config.model_path,
            "--host", f"$(POD_NAME).{NODE_SERVICE}", "--port", str(server_port(config, slot)),
            "--server-id", "rollout-${server}", "--redis-url", config.redis_url, "--config", CONFIG_PATH,
            "--metrics-port", str(layout.ROLLOUT_METRICS_PORT + slot),
        ]  # fmt: skip
        start = f"CUDA_VISIBLE_DEVICES={devices} {' '.join(_shell_word(part) for part in argv)} & servers+=($!)"
        if nodes.spans_nodes:  # the first node of each replica starts it
            replicas = nodes.nodes_per_replica
            lines.append(f"server=$((NODE_RANK / {replicas}))")
            lines.append(f"if [ $((NODE_RANK % {replicas})) -eq 0 ]; then {start}; fi")
        else:
            lines.append(f"server=$((NODE_RANK * {nodes.servers_per_node} + {slot}))")
            lines.append(start)
    rendezvous = Rendezvous(f"{NODE_SERVICE}-0.{NODE_SERVICE}:{layout.RDZV_PORT}", "${NODE_RANK}", config.run_id)
    trainer = ["python", *trainer_argv(config, trainer_role_args(config), rendezvous)]
    lines += [
        " ".join(_shell_word(part) for part in trainer),
        "code=$?",
        'if [ ${#servers[@]} -gt 0 ]; then kill "${servers[@]}" 2>/dev/null; wait "${servers[@]}"; fi',
        "exit $code",
    ]
    return "\n".join(lines)


def node_manifest(config: RunConfig, options: RenderOptions, nodes: NodeLayout) -> Manifest:
    volumes, mounts = zip(
        config_volume(), model_volume(config, options), run_volume(options), shm_volume(), strict=False
    )
    env = [
        field_env("POD_IP", "status.podIP"),
        field_env("POD_NAME", "metadata.name"),
        field_env("NODE_RANK", "metadata.annotations['batch.kubernetes.io/job-completion-index']"),
    ]
    servers = max((len(nodes.servers_on(node)) for node in range(nodes.num_nodes)), default=0)
    ports = [{"name": "rdzv", "containerPort": layout.RDZV_PORT}]
    ports += [{"name": f"grpc-{slot}", "containerPort": server_port(config, slot)} for slot in range(servers)]
    main = container(
        options, "node", ["bash", "-c", node_script(config, nodes)], list(mounts), env=env, ports=ports,
        resources=gpu_limits(nodes.gpus_per_node),
    )  # fmt: skip
    annotations = {}
    comment = [
        f"Colocated: {nodes.num_nodes} node pods (an Indexed Job; pod i is node-i.node) x {nodes.gpus_per_node} GPUs,",
        "each running trainer node rank i (torchrun) and the rollout servers whose GPUs are on node i, sharing the",
        f"GPUs (the engine takes rollout.gpu_memory_utilization = {config.rollout.gpu_memory_utilization}).",
        "Weights go in memory to the servers of rank 0's node (weight_bus.transport ipc), over tcp to the others.",
        "The pod exits with the trainer; a crashed pod restarts and the trainer resumes per trainer.resume.",
    ]
    if nodes.spans_nodes:
        note = (
            f"NOT STARTABLE AS IS: a rollout replica needs {nodes.gpus_per_replica} GPUs over "
            f"{nodes.nodes_per_replica} node pods; vLLM across pods needs a Ray cluster per replica, which "
            "rollout_service does not start. The first node of each replica starts a server asking for all its GPUs."
        )
        annotations["fleetrl/multi-node-rollout"] = note
        comment.append(note)
    template_meta = {"labels": labels(config, ROLE), "annotations": scrape_annotations(config.trainer.metrics_port)}
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": metadata(config, NODE_SERVICE, ROLE, annotations),
        "spec": {
            "completionMode": "Indexed",
            "completions": nodes.num_nodes,
            "parallelism": nodes.num_nodes,
            "backoffLimit": options.backoff_limit,
            "template": {
                "metadata": template_meta,
                "spec": {
                    "subdomain": NODE_SERVICE,
                    "restartPolicy": "OnFailure",
                    "containers": [main],
                    "volumes": list(volumes),
                },
            },
        },
    }
    service = headless_service(config, NODE_SERVICE, ROLE, layout.RDZV_PORT)
    return Manifest("30-node.yaml", comment, [service, job])


def node_pods(config: RunConfig, nodes: NodeLayout) -> layout.RolePods:
    return layout.RolePods("node (trainer + rollout)", config.trainer.num_nodes, nodes.gpus_per_node)
