"""MegatronBackend and the trainer loop as two gloo ranks (torchrun, CPU, fp32) against world size 1.

Each torchrun start imports megatron (~10-15 s), so one launch runs every backend check (multirank_worker.py):
PP=2 on the tiny Qwen3-MoE and the tiny Beam, then DP=2 on the tiny Qwen3-MoE. The world-size-1 references run in this process.
(The worker rebuilds megatron's parallel state between the two layouts.) The end-to-end test runs ``python -m trainer_service train`` as two ranks (PP=2) against the embedded Redis, then
restarts it from its checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import torch
from multirank_worker import GRAD_CLIP, LR, random_routes, step_batch, trainer_config
from safetensors.torch import load_file
from synthetic import make_group, push_groups

from modeling.beam.tiny import init_tiny_beam
from modeling.tiny_model import init_tiny
from protos.records import decode_manifest
from protos.redis_keys import RedisKeys
from tests.waiting import wait_until
from weight_bus import packing, receiver

pytestmark = pytest.mark.e2e

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
ROUTE_SHAPES = {"qwen": (2, 2, 16), "beam": (5, 4, 16)}  # (MoE layers, top-k, experts)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The references here run beside two ranks on a small machine: oversubscribed cores stall the ranks."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {"qwen": str(init_tiny(root / "qwen", seed=0, num_experts=16)), "beam": str(init_tiny_beam(root / "beam"))}


def _launch_worker(out: Path, qwen_dir: str, beam_dir: str) -> subprocess.Popen:
    worker = Path(__file__).with_name("multirank_worker.py")
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "log.txt", "wb")
    return subprocess.Popen(
        [*TORCHRUN, str(worker), str(out), qwen_dir, beam_dir],
        cwd=worker.parent,
        env=ENV,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _ranks_results(process: subprocess.Popen, out: Path) -> list[dict]:
    assert process.wait(timeout=300) == 0, (out / "log.txt").read_text()[-4000:]
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(2)]


def _reference(model_dir: str, route_shape) -> dict:
    """World size 1: log-probs (natural and replayed) and one step's figures and weights on ``step_batch()``."""
    from trainer_service.megatron.backend import MegatronBackend

    backend = MegatronBackend(model_dir, trainer_config())
    before = {name: tensor.clone() for name, tensor in backend.export_hf_weights()}
    batch = step_batch()
    return {
        "logprobs": backend.token_logprobs(batch.input_ids_BT, batch.attention_mask_BT),
        "replayed": backend.token_logprobs(
            batch.input_ids_BT, batch.attention_mask_BT, routed_experts=random_routes(batch, *route_shape)
        ),
        "step": backend.train_step(batch),
        "weights": dict(backend.export_hf_weights()),
        "before": before,
    }


def _assert_same_as_world_size_1(ranks: list[dict], reference: dict) -> None:
    real_targets = step_batch().attention_mask_BT[:, 1:].bool()
    for key in ("logprobs", "replayed"):
        assert torch.equal(ranks[0][key], ranks[1][key]), key  # every rank returns the same tensor
        assert (ranks[0][key] - reference[key])[real_targets].abs().max() < 1e-5, key
    assert ranks[0]["step"] == ranks[1]["step"]
    got, want = ranks[0]["step"], reference["step"]
    assert got["skipped"] == 0.0 and got["micro_batches"] > 2
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    # Weights: relative to the step's largest update (see multirank_worker.LR / GRAD_CLIP).
    weights, expected, before = ranks[0]["weights"], reference["weights"], reference["before"]
    assert sorted(weights) == sorted(expected)
    assert all(torch.equal(weights[name], ranks[1]["weights"][name]) for name in weights)
    largest_update = max((expected[name] - before[name]).abs().max().item() for name in expected)
    largest_error = max((weights[name] - expected[name]).abs().max().item() for name in expected)
    assert largest_update > 1e-3 and largest_error <= 1e-5 * largest_update
    assert all(r.get("resume_exact", True) for r in ranks)


def test_pipeline_and_data_parallel_ranks_match_world_size_1(model_dirs, tmp_path):
    """PP=2 (Qwen3-MoE and Beam) and DP=2 (Qwen3-MoE): the same log-probs, R3 replay, micro-batched step and
    exported weights as one rank, identical on both ranks; resuming from a checkpoint repeats the next step; a
    non-finite loss skips the step on every rank."""
    workers = _launch_worker(tmp_path, model_dirs["qwen"], model_dirs["beam"])
    references = {name: _reference(model_dirs[name], ROUTE_SHAPES[name]) for name in ("qwen", "beam")}
    ranks = _ranks_results(workers, tmp_path)
    assert [r["pp"]["layout"] for r in ranks] == [{"pp": 2, "world": 2}] * 2
    assert [r["dp"]["layout"] for r in ranks] == [{"pp": 1, "world": 2}] * 2
    for layout, name in (("pp", "qwen"), ("pp", "beam"), ("dp", "qwen")):
        _assert_same_as_world_size_1([r[layout][name] for r in ranks], references[name])
    assert all(r[layout]["qwen"]["resume_exact"] for r in ranks for layout in ("pp", "dp"))
    # A NaN in one shard's rows: every rank skips the step alike and keeps its weights.
    assert all(
        r[layout]["qwen"]["nan_step"] == {"skipped": 1.0, "kept": True} for r in ranks for layout in ("pp", "dp")
    )


# -- the trainer loop as two ranks ----------------------------------------------------------------------------

RUN_ID = "multirank-test"
GROUPS_PER_STEP = 2


def _start_trainer(model_dir: str, url: str, ckpt_dir: Path, log: Path, num_steps: int, linger_s: float):
    command = [
        *TORCHRUN,
        "-m",
        "trainer_service",
        "train",
        "--model",
        model_dir,
        "--redis-url",
        url,
        "--linger-s",
        str(linger_s),
        f"run_id={RUN_ID}",
        f"trainer.ckpt_dir={ckpt_dir}",
        f"num_steps={num_steps}",
        f"groups_per_step={GROUPS_PER_STEP}",
        "max_staleness=1000",
        "trainer.geo_mask=null",
        "trainer.batch_timeout_s=60",
        "trainer.backend=megatron",
        "trainer.num_processes=2",
        "trainer.megatron.pipeline_model_parallel_size=2",
        "trainer.micro_batch_tokens=40",
        f"trainer.lr={LR}",
        f"trainer.grad_clip={GRAD_CLIP}",
        "trainer.mini_batches=2",
    ]
    return subprocess.Popen(
        command,
        stdout=open(log, "ab"),
        stderr=subprocess.STDOUT,
        env=ENV,
        cwd=Path(__file__).parents[2],
        start_new_session=True,
    )


def _fetch_published(client: redis.Redis, keys: RedisKeys, version: int) -> dict[str, torch.Tensor]:
    """What a rollout server would load: version ``version`` over the weight bus (checksums verified)."""
    manifest = decode_manifest(client.get(keys.manifest(version)))
    buffer = bytearray(packing.total_nbytes(manifest))
    assert receiver.receive_into(manifest, memoryview(buffer), timeout_s=10) == "publisher"
    return {name: tensor.clone() for name, tensor in packing.iter_tensors(manifest, memoryview(buffer))}


def _wait_for_done(client: redis.Redis, keys: RedisKeys, trainer: subprocess.Popen, log: Path) -> None:
    def reported_done() -> bool:
        assert trainer.poll() is None, log.read_text()[-4000:]
        return any(b"d" in fields for _, fields in client.xrange(keys.metrics("trainer")))

    wait_until(reported_done, "the trainer's done report", 240, poll_s=0.1)


def _reference_weights(model_dir: str, num_steps: int) -> dict[str, torch.Tensor]:
    """One process training the same groups in the same order (two mini-batches per step, as the run)."""
    from trainer_service.megatron.backend import MegatronBackend
    from trainer_service.trainer import Trainer

    trainer = Trainer(MegatronBackend(model_dir, trainer_config()), 1000, mini_batches=2)
    for step in range(num_steps):
        trainer.step(
            [make_group(i, version=0, seed=11) for i in range(step * GROUPS_PER_STEP, (step + 1) * GROUPS_PER_STEP)]
        )
    return dict(trainer.backend.export_hf_weights())


def _group_info(client: redis.Redis, keys: RedisKeys) -> dict:
    return keys.trainer_group_info(client.xinfo_groups(keys.trajectories))


def test_two_rank_trainer_trains_publishes_checkpoints_and_resumes(redis_server, model_dirs, tmp_path):
    """PP=2 trainer: 2 steps (2 mini-batches each) on 4 of 8 groups, the published v2 equals one process's
    weights, exactly the consumed entries are acknowledged; a restart resumes at step 2 and trains the rest."""
    keys, client = RedisKeys(RUN_ID), redis.Redis.from_url(redis_server.url)
    client.delete(*client.keys(f"fleetrl:{RUN_ID}:*") or ["-"])
    ckpt_dir, log = tmp_path / "ckpt", tmp_path / "trainer.log"
    push_groups(redis_server.url, keys, list(range(8)))

    first = _start_trainer(model_dirs["qwen"], redis_server.url, ckpt_dir, log, num_steps=2, linger_s=2)
    reference = _reference_weights(model_dirs["qwen"], 2)
    _wait_for_done(client, keys, first, log)
    published = _fetch_published(client, keys, 2)  # while rank 0 lingers
    assert first.wait(timeout=60) == 0, log.read_text()[-4000:]
    state = json.loads((ckpt_dir / (ckpt_dir / "latest").read_text() / "trainer_state.json").read_text())
    assert state["step"] == 2 and sorted(state["ledger"]) == [f"g{i}" for i in range(4)]
    assert len(list((ckpt_dir / "step-000002").glob("rank*.pt"))) == 2  # a shard per rank
    group = _group_info(client, keys)
    assert group["pending"] == 0 and group["lag"] == 4  # exactly the consumed entries were acknowledged
    assert int(client.get(keys.policy_version)) == 2
    initial = load_file(f"{model_dirs['qwen']}/model.safetensors")
    largest_update = max((reference[name] - initial[name]).abs().max().item() for name in reference)
    largest_error = max((published[name] - reference[name]).abs().max().item() for name in reference)
    assert sorted(published) == sorted(reference) and largest_error <= 1e-5 * largest_update

    client.delete(keys.metrics("trainer"))
    second = _start_trainer(model_dirs["qwen"], redis_server.url, ckpt_dir, log, num_steps=4, linger_s=0)
    assert second.wait(timeout=240) == 0, log.read_text()[-4000:]
    state = json.loads((ckpt_dir / (ckpt_dir / "latest").read_text() / "trainer_state.json").read_text())
    assert state["step"] == 4 and sorted(state["ledger"]) == [f"g{i}" for i in range(8)]
    assert set(state["ledger"].values()) == {"trained"}
    assert "trainer start: step 2, policy_version=2" in log.read_text()  # resumed, not restarted
    group = _group_info(client, keys)
    assert group["pending"] == 0 and group["lag"] == 0 and int(client.get(keys.policy_version)) == 4
    client.close()


def test_launcher_starts_a_multi_rank_trainer_under_torchrun_and_refuses_several_nodes():
    from launcher.demo import trainer_command
    from protos.config import RunConfig

    assert trainer_command(RunConfig()) == ["-m", "trainer_service", "train"]
    two_ranks = RunConfig.model_validate({"trainer": {"backend": "megatron", "num_processes": 2}})
    assert trainer_command(two_ranks) == [
        "-m",
        "trainer_service.torchrun",  # torchrun keeping a rank's exit code 78
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "trainer_service",
        "train",
    ]
    two_nodes = RunConfig.model_validate({"trainer": {"backend": "megatron", "num_nodes": 2}})
    with pytest.raises(ValueError, match="trainer.num_nodes=2"):
        trainer_command(two_nodes)
