"""One builder of the trainer's command line (protos.trainer_command): the launcher and deploy/ agree on it."""

from __future__ import annotations

import pytest

from deploy import commands
from launcher import demo
from protos.config import RunConfig
from protos.trainer_command import Rendezvous, trainer_argv
from trainer_service.__main__ import parse_args

pytestmark = pytest.mark.unit

RENDEZVOUS = Rendezvous(endpoint="trainer-0.trainer:29400", node_rank="$(NODE_RANK)", run_id="r1")


def _config(**trainer) -> RunConfig:
    return RunConfig.model_validate(
        {"run_id": "r1", "model_path": "/models/m", "redis_url": "redis://redis:6379", "trainer": trainer}
    )


ONE_NODE_LAYOUTS = [{}, {"backend": "megatron", "num_processes": 2}, {"backend": "megatron", "num_processes": 8}]


@pytest.mark.parametrize("trainer", ONE_NODE_LAYOUTS, ids=["one-process", "two-ranks", "eight-ranks"])
def test_the_launcher_and_deploy_start_the_same_trainer_argv_for_the_same_config(trainer):
    config = _config(**trainer)
    role_args = commands.trainer_role_args(config)
    assert commands.trainer_command(config) == ["python", *demo.trainer_command(config, role_args)]


def test_one_process_runs_the_module_and_its_flags_parse_as_the_trainers():
    argv = trainer_argv(_config(), ["--config", "run.json", "trainer.lr=1e-5"])
    assert argv == ["-m", "trainer_service", "train", "--config", "run.json", "trainer.lr=1e-5"]
    parsed = parse_args(argv[2:])
    assert parsed.config == "run.json" and parsed.overrides == ["trainer.lr=1e-5"]


def test_several_ranks_run_under_torchrun_standalone_on_one_node():
    argv = trainer_argv(_config(backend="megatron", num_processes=4), ["--config", "run.json"])
    assert argv == [
        *("-m", "trainer_service.torchrun", "--standalone", "--nproc-per-node", "4"),
        *("-m", "trainer_service", "train", "--config", "run.json"),
    ]


def test_several_nodes_meet_at_the_rendezvous_and_need_one():
    config = _config(backend="megatron", num_processes=8, num_nodes=2)
    argv = trainer_argv(config, [], RENDEZVOUS)
    torchrun = argv[: argv.index("trainer_service") - 1]
    flags = dict(zip(torchrun[2::2], torchrun[3::2], strict=True))
    assert flags == {
        "--nnodes": "2",
        "--nproc-per-node": "8",
        "--node-rank": "$(NODE_RANK)",
        "--rdzv-backend": "c10d",
        "--rdzv-endpoint": "trainer-0.trainer:29400",
        "--rdzv-id": "r1",
    }
    assert commands.trainer_command(config)[1:] == trainer_argv(config, commands.trainer_role_args(config), RENDEZVOUS)
    with pytest.raises(ValueError, match="trainer.num_nodes=2"):
        trainer_argv(config)
    with pytest.raises(ValueError, match="trainer.num_nodes=2"):
        demo.trainer_command(config)  # the launcher starts one node
