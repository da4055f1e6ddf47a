"""The role processes of a run, built from its resolved config: one builder for both launchers.

``fleetrl demo`` (launcher/demo.py) runs each ``RoleSpec`` as a process on this machine; ``fleetrl up``
(launcher/ray_launcher.py) hands each one to a Ray actor that runs it as a process on its node. Every role reads
the same resolved config file (``--config``); a spec adds only what differs per instance (ports, server ids, the
torchrun-equivalent environment of a trainer rank). The trainer's argv comes from ``protos.trainer_command``, which
the Kubernetes renderer (deploy/) shares.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from protos.config import RunConfig
from protos.trainer_command import TRAINER_MODULE, trainer_argv

ROLLOUT, TRAINER, COORDINATOR, AGENT, REDIS = "rollout", "trainer", "coordinator", "agent", "redis"


@dataclass(frozen=True)
class RoleSpec:
    """One role process: ``python ARGV`` with ``env`` on top of the launcher's environment."""

    name: str  # rollout-0, trainer, trainer-rank-1, coordinator, agent-0: its log is logs/<name>.log
    kind: str  # ROLLOUT | TRAINER | COORDINATOR | AGENT | REDIS (the embedded valkey of ``fleetrl demo``)
    argv: tuple[str, ...]  # after the interpreter
    env: dict[str, str] = field(default_factory=dict)
    address_file: str = ""  # a rollout server writes host:port here once it serves

    @property
    def serves_until_stopped(self) -> bool:
        """A rollout server (and the embedded Redis) serves until the launcher stops it: any exit of one is a
        failure. The other roles exit 0 once their work is done."""
        return self.kind in (ROLLOUT, REDIS)


def rollout_spec(config: RunConfig, config_path: Path, out_dir: Path, index: int, host: str = "") -> RoleSpec:
    """Rollout server ``index``: a free port unless ``rollout.base_port`` fixes one (it writes the port it bound to
    its address file: a port picked by a launcher could be taken during the engine's start), ``--host`` when the
    launcher knows a better interface than ``rollout.host`` (another node's coordinator must reach it)."""
    name = f"rollout-{index}"
    rollout = config.rollout
    address_file = out_dir / f"{name}.address"
    argv = [
        "-m",
        "rollout_service",
        "serve",
        "--port",
        str(rollout.base_port + index if rollout.base_port else 0),
        "--address-file",
        str(address_file),
        "--server-id",
        name,
        "--config",
        str(config_path),
    ]
    if host:
        argv += ["--host", host]
    # One engine thread per server, each bound to its own core where the machine has several (the CPU engine).
    env = {"VLLM_CPU_OMP_THREADS_BIND": str(index % (os.cpu_count() or 1)), "OMP_NUM_THREADS": "1"}
    return RoleSpec(name, ROLLOUT, tuple(argv), env, str(address_file))


def trainer_spec(config: RunConfig, config_path: Path) -> RoleSpec:
    """The whole trainer as one process: ``trainer.num_processes`` ranks under torchrun on this node, or one."""
    return RoleSpec(TRAINER, TRAINER, tuple(trainer_argv(config, ["--config", str(config_path)])))


def trainer_rank_spec(config_path: Path, rank_env: dict[str, str], extra_args: tuple[str, ...] = ()) -> RoleSpec:
    """One trainer rank started by the launcher itself (``fleetrl up``): what torchrun would set, in ``rank_env``."""
    name = TRAINER if rank_env["WORLD_SIZE"] == "1" else f"trainer-rank-{rank_env['RANK']}"
    return RoleSpec(name, TRAINER, (*TRAINER_MODULE, "--config", str(config_path), *extra_args), dict(rank_env))


def rank_environments(
    rank_nodes: list[str], rank_gpus: list[list[str]], master_addr: str, master_port: int
) -> list[dict[str, str]]:
    """torchrun's environment for each rank of a gang placed by Ray: rank i runs on node ``rank_nodes[i]`` with
    the GPU ids Ray gave it, ``rank_gpus[i]`` (empty on CPU).

    Ranks are numbered in gang order; LOCAL_RANK counts the ranks before it on its node. Ray gives each rank's
    actor only its own GPU; a rank process sees every GPU of its node's ranks (CUDA_VISIBLE_DEVICES in local rank
    order), so LOCAL_RANK indexes its own and the ranks of one node reach each other's GPUs, as under torchrun.
    """
    nodes = list(dict.fromkeys(rank_nodes))  # in order of their first rank: node rank 0 holds rank 0
    envs = []
    for rank, node in enumerate(rank_nodes):
        on_node = [r for r, n in enumerate(rank_nodes) if n == node]
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": str(len(rank_nodes)),
            "LOCAL_RANK": str(on_node.index(rank)),
            "LOCAL_WORLD_SIZE": str(len(on_node)),
            "GROUP_RANK": str(nodes.index(node)),
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
        }
        node_gpus = [gpu for r in on_node for gpu in rank_gpus[r]]
        if node_gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(node_gpus)
        envs.append(env)
    return envs


def coordinator_spec(
    config: RunConfig, config_path: Path, addresses: list[str], extra_args: tuple[str, ...] = ()
) -> RoleSpec:
    """The coordinator; with ``coordinator.discovery`` it finds the servers in Redis (then a restarted coordinator
    never starts on a stale list), else it is handed ``addresses``. ``extra_args``: dotted overrides."""
    servers = [] if config.coordinator.discovery else ["--servers", ",".join(addresses)]
    argv = ("-m", "coordinator", "run", *servers, "--config", str(config_path), *extra_args)
    return RoleSpec(COORDINATOR, COORDINATOR, argv)


def read_address(spec: RoleSpec) -> str | None:
    """host:port from a rollout server's address file, or None while it is not serving."""
    try:
        return Path(spec.address_file).read_text().strip() or None
    except FileNotFoundError:
        return None
