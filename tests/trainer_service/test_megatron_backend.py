"""MegatronBackend on CPU (gloo, world size 1, fp32) against the torch backend, plus R3 through megatron-core.

One tiny Qwen3-MoE (16 experts, so that short inputs leave experts unused for the router-perturbation tests) is
built per module; read-only tests share one backend, tests that train or perturb build their own (~0.1 s each
once megatron is imported).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from router_perturbation import perturb_unused_experts
from safetensors.torch import load_file

from modeling.tiny_model import init_tiny
from protos.config import TrainerConfig
from protos.records import Array, FinishReason, Sample, TrajectoryGroup, VersionSpan
from trainer_service.batch import build_batch
from trainer_service.megatron.backend import MegatronBackend
from trainer_service.megatron.routing_replay import megatron_record_routes
from trainer_service.routing_replay import record_routes, routes_from_groups
from trainer_service.torch_backend import TorchBackend, token_logprobs

pytestmark = pytest.mark.integration

CONFIG = TrainerConfig(backend="megatron", lr=1e-2, geo_mask=None)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(init_tiny(tmp_path_factory.mktemp("tiny"), seed=0, num_experts=16))


@pytest.fixture(scope="module")
def megatron(model_dir):
    """Shared and never trained: tests that change weights build their own."""
    return MegatronBackend(model_dir, CONFIG)


@pytest.fixture(scope="module")
def torch_backend(model_dir):
    return TorchBackend(model_dir, CONFIG)


def _group(prompt: list[int], responses: list[list[int]], rewards: list[float], routes=None, logprobs=None):
    samples = []
    for i, (response, reward) in enumerate(zip(responses, rewards, strict=True)):
        lps = np.full(len(response), -3.0, np.float32) if logprobs is None else logprobs[i]
        samples.append(
            Sample(
                Array.from_numpy(np.array(response, np.int32)),
                Array.from_numpy(lps),
                [VersionSpan(0, 0, len(response))],
                FinishReason.LENGTH,
                reward,
                routed_experts=None if routes is None else Array.from_numpy(routes[i]),
            )
        )
    return TrajectoryGroup("g", "p", Array.from_numpy(np.array(prompt, np.int32)), samples, "test", 0, 0, 0.0)


def _padded_batch():
    return build_batch(
        [
            _group([1, 5, 6], [[7, 8, 9, 10], [11, 12]], [1.0, 0.0]),
            _group([1, 9], [[13, 14, 15, 16, 17], [18]], [0.0, 1.0]),
        ]
    )


def _router_weights(backend: MegatronBackend) -> list[torch.Tensor]:
    return [layer.mlp.router.weight for layer in backend.model[0].module.decoder.layers]


# -- parity with the torch backend ----------------------------------------------------------------------------


def test_megatron_logprobs_match_torch_backend_on_a_padded_batch(megatron, torch_backend):
    batch = _padded_batch()
    with torch.no_grad():
        expected = token_logprobs(torch_backend.model, batch.input_ids_BT, batch.attention_mask_BT, 1.0)
    actual = megatron.token_logprobs(batch.input_ids_BT, batch.attention_mask_BT)
    real_targets = batch.attention_mask_BT[:, 1:].bool()
    assert actual.shape == expected.shape
    assert (actual - expected)[real_targets].abs().max() < 1e-4


def test_each_group_is_scored_at_the_temperature_it_was_sampled_at_in_both_backends(megatron, torch_backend):
    import msgspec

    hot = msgspec.structs.replace(_group([1, 5, 6], [[7, 8, 9, 10], [11, 12]], [1.0, 0.0]), sampling_temperature=0.5)
    unrecorded = _group([1, 9], [[13, 14, 15, 16, 17], [18]], [0.0, 1.0])  # older coordinator: the backend's own
    batch = build_batch([hot, unrecorded])
    with torch.no_grad():
        expected = torch.cat(
            [
                token_logprobs(torch_backend.model, batch.input_ids_BT[:2], batch.attention_mask_BT[:2], 0.5),
                token_logprobs(torch_backend.model, batch.input_ids_BT[2:], batch.attention_mask_BT[2:], 1.0),
            ]
        )
    real_targets = batch.attention_mask_BT[:, 1:].bool()
    for backend in (torch_backend, megatron):
        assert backend.temperature == 1.0
        actual = backend.policy_logprobs(batch)
        assert (actual - expected)[real_targets].abs().max() < 1e-4, type(backend).__name__


def test_megatron_export_is_bit_exact_with_the_hf_checkpoint(megatron, model_dir):
    checkpoint = load_file(f"{model_dir}/model.safetensors")
    exported = dict(megatron.export_hf_weights())
    assert sorted(exported) == sorted(checkpoint)
    assert "model.layers.0.mlp.experts.15.down_proj.weight" in exported  # per-expert names, as vLLM loads
    for name, tensor in checkpoint.items():
        assert exported[name].shape == tensor.shape, name
        assert torch.equal(exported[name], tensor), name


def test_the_export_plan_gives_the_bridges_tensors_after_a_training_step(model_dir):
    megatron = MegatronBackend(model_dir, CONFIG)
    dict(megatron.export_hf_weights())  # the first export learns the plan from the bridge
    plan = megatron._export.plan
    assert plan is not None and {type(s).__name__ for _, s in plan.sources} == {"ViewOf", "RowsOf"}  # q/k/v gathered
    megatron.train_step(_padded_batch())
    planned = {name: tensor.clone() for name, tensor in megatron.export_hf_weights()}
    bridge = dict(megatron.bridge.export_hf_weights(megatron.model, cpu=True, show_progress=False))
    assert list(planned) == list(bridge)
    for name, tensor in bridge.items():
        assert torch.equal(planned[name], tensor), name


def test_megatron_train_step_changes_weights_like_the_torch_backend(model_dir):
    megatron, torch_ref = MegatronBackend(model_dir, CONFIG), TorchBackend(model_dir, CONFIG)
    batch = _padded_batch()
    before = dict(megatron.export_hf_weights())

    metrics, expected = megatron.train_step(batch), torch_ref.train_step(batch)

    assert metrics["skipped"] == 0.0 and math.isfinite(metrics["loss"])
    assert metrics["loss"] == pytest.approx(expected["loss"], abs=1e-6)
    assert metrics["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4)
    after, torch_after = dict(megatron.export_hf_weights()), dict(torch_ref.export_hf_weights())
    assert any(not torch.equal(before[name], after[name]) for name in before)
    assert max((after[name] - torch_after[name]).abs().max().item() for name in after) < 1e-4


def test_megatron_non_finite_loss_skips_the_step_and_keeps_weights(model_dir):
    megatron = MegatronBackend(model_dir, CONFIG)
    batch = _padded_batch()
    batch.advantages_B[0] = float("nan")
    before = dict(megatron.export_hf_weights())
    metrics = megatron.train_step(batch)
    assert metrics["skipped"] == 1.0
    assert all(torch.equal(before[name], tensor) for name, tensor in megatron.export_hf_weights())


def test_megatron_resume_from_checkpoint_is_bit_identical_to_continuing(model_dir, tmp_path):
    from megatron_checks import assert_resume_is_bit_identical

    assert_resume_is_bit_identical(model_dir, CONFIG, _padded_batch(), tmp_path)


def _inputs(batch: int, seq: int, seed: int = 0):
    ids = torch.randint(3, 64, (batch, seq), generator=torch.Generator().manual_seed(seed))
    return ids, torch.ones_like(ids)


def test_megatron_records_the_routes_transformers_chooses(megatron, torch_backend):
    ids, attention = _inputs(3, 8)
    with megatron_record_routes(megatron.model) as recorder:
        megatron.token_logprobs(ids, attention)
    with torch.no_grad(), record_routes(torch_backend.model) as hf_recorder:
        torch_backend.model(input_ids=ids)
    # Same experts per (sample, token, layer): megatron's sequence-major token order is undone correctly.
    ours, theirs = recorder.routes(*ids.shape), hf_recorder.routes(*ids.shape)
    assert torch.equal(ours.sort(dim=-1).values, theirs.sort(dim=-1).values)


def test_megatron_replay_of_recorded_routes_reproduces_logprobs_exactly(megatron):
    ids, attention = _inputs(3, 8)
    with megatron_record_routes(megatron.model) as recorder:
        recorded = megatron.token_logprobs(ids, attention)
    replayed = megatron.token_logprobs(ids, attention, routed_experts=recorder.routes(*ids.shape))
    assert torch.equal(replayed, recorded)


def test_megatron_without_routes_routes_naturally(megatron):
    ids, attention = _inputs(2, 6)
    first = megatron.token_logprobs(ids, attention, routed_experts=None)
    assert torch.equal(megatron.token_logprobs(ids, attention), first)


def test_megatron_replay_reproduces_recorded_logprobs_after_the_router_changed(model_dir):
    megatron = MegatronBackend(model_dir, CONFIG)
    ids, attention = _inputs(2, 3, seed=2)
    with megatron_record_routes(megatron.model) as recorder:
        recorded = megatron.token_logprobs(ids, attention)
    routes = recorder.routes(*ids.shape)
    perturb_unused_experts(_router_weights(megatron), routes)

    with megatron_record_routes(megatron.model) as recorder:
        natural = megatron.token_logprobs(ids, attention)
    assert not torch.equal(recorder.routes(*ids.shape), routes)
    assert (natural - recorded).abs().max() > 1e-3
    assert torch.equal(megatron.token_logprobs(ids, attention, routed_experts=routes), recorded)


def test_megatron_train_step_replays_rollout_routes_and_trains_the_router(model_dir, torch_backend):
    """Rollout-side routes (vLLM layout, recorded on the HF model) drive a megatron step on a changed router."""
    prompt, responses = [1, 5], [[7, 8], [9, 10]]
    rows = torch.tensor([prompt + response for response in responses])
    with torch.no_grad(), record_routes(torch_backend.model) as recorder:
        rollout_lps = token_logprobs(torch_backend.model, rows, torch.ones_like(rows), 1.0)
    hf_routes = recorder.routes(*rows.shape)
    vllm_routes = [hf_routes[i, : rows.shape[1] - 1].numpy().astype(np.int32) for i in range(len(responses))]
    response_lps = [rollout_lps[i, len(prompt) - 1 :].numpy() for i in range(len(responses))]
    groups = [_group(prompt, responses, [1.0, 0.0], routes=vllm_routes, logprobs=response_lps)]
    batch = build_batch(groups)
    routes = routes_from_groups(groups, width=batch.input_ids_BT.shape[1])

    megatron = MegatronBackend(model_dir, CONFIG)
    perturb_unused_experts(_router_weights(megatron), hf_routes)
    natural = megatron.token_logprobs(batch.input_ids_BT, batch.attention_mask_BT)
    assert ((natural - batch.rollout_logprobs_BT).abs() * batch.loss_mask_BT).max() > 1e-3
    routers_before = [weight.detach().clone() for weight in _router_weights(megatron)]

    metrics = megatron.train_step(batch, routed_experts=routes)

    # pi_old (replayed) equals the rollout policy: no trainer/inference mismatch left.
    assert metrics["mean_abs_logprob_diff"] < 1e-5 and metrics["skipped"] == 0.0
    for before, after in zip(routers_before, _router_weights(megatron), strict=True):
        assert not torch.equal(before, after)


def test_megatron_micro_batches_give_the_same_step_as_one_batch(model_dir):
    from synthetic import make_group

    batch = build_batch([make_group(i, seed=7) for i in range(4)])
    results = {}
    for budget in (0, 40):
        backend = MegatronBackend(model_dir, TrainerConfig(geo_mask=None, micro_batch_tokens=budget))
        values = backend.train_step(batch)
        results[budget] = (values, dict(backend.export_hf_weights()))
    (whole, whole_weights), (split, split_weights) = results[0], results[40]
    assert split["micro_batches"] > 2 and whole["micro_batches"] == 1
    assert split["loss"] == pytest.approx(whole["loss"], abs=1e-6)
    assert split["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-5)
    assert max((whole_weights[k] - split_weights[k]).abs().max().item() for k in whole_weights) < 1e-4


def test_megatron_mini_batches_step_twice_against_the_step_start_policy(model_dir):
    from synthetic import make_group

    from trainer_service.trainer import Trainer

    trainer = Trainer(MegatronBackend(model_dir, TrainerConfig(geo_mask=None)), max_staleness=1, mini_batches=2)
    values = trainer.step([make_group(i, seed=9) for i in range(4)])
    assert values["mini_batches"] == 2 and values["skipped"] == 0.0 and trainer.policy_version == 1
    assert values["clip_frac"] > 0.0  # the second update's ratio is against the policy before the first
