"""The trainer's command line: the contract between what starts the trainer and ``trainer_service.__main__``.

One builder for every starter: ``launcher.demo`` (``fleetrl demo``, one machine) and ``deploy.manifests``
(the Kubernetes trainer pods). The argv starts after the interpreter (``sys.executable`` or the image's
``python``): ``-m trainer_service train ROLE_ARGS`` for one process, the same under ``-m trainer_service.torchrun``
(torchrun, keeping a rank's exit code 78) for ``trainer.num_processes`` ranks (``--standalone`` on one node, a c10d
rendezvous over ``trainer.num_nodes``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from protos.config import RunConfig

TRAINER_MODULE = ("-m", "trainer_service", "train")
TORCHRUN_MODULE = "trainer_service.torchrun"  # torchrun's arguments; a rank's exit code 78 becomes its own


@dataclass(frozen=True)
class Rendezvous:
    """Where the torchrun agents of several nodes meet (c10d); values may be shell-style env references."""

    endpoint: str  # host:port of the c10d store
    node_rank: str  # this node's rank, e.g. "$(NODE_RANK)" on Kubernetes
    run_id: str  # torchrun's --rdzv-id


def trainer_argv(config: RunConfig, role_args: Sequence[str] = (), rendezvous: Rendezvous | None = None) -> list[str]:
    """``-m ... trainer_service train ROLE_ARGS`` for ``config.trainer``'s layout (interpreter not included).

    ``role_args``: the trainer's own flags and overrides (``--config``, ``--model``, ``key=value``).
    ``rendezvous``: required when ``trainer.num_nodes`` > 1.
    """
    tcfg = config.trainer
    role = [*TRAINER_MODULE, *role_args]
    if tcfg.num_nodes == 1 and tcfg.num_processes == 1:
        return role
    if tcfg.num_nodes == 1:
        # --standalone: a local rendezvous on a free port; torchrun stops every rank when one fails.
        ranks = ["--standalone", "--nproc-per-node", str(tcfg.num_processes)]
    elif rendezvous is None:
        raise ValueError(f"trainer.num_nodes={tcfg.num_nodes}: several nodes need a rendezvous endpoint (deploy/)")
    else:
        ranks = [
            "--nnodes",
            str(tcfg.num_nodes),
            "--nproc-per-node",
            str(tcfg.num_processes),
            "--node-rank",
            rendezvous.node_rank,
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            rendezvous.endpoint,
            "--rdzv-id",
            rendezvous.run_id,
        ]
    return ["-m", TORCHRUN_MODULE, *ranks, *role]
