"""Trainer core on recorded groups (no vLLM): staleness bound, version advance, NaN skip."""

from __future__ import annotations

import numpy as np
import pytest

from modeling.tiny_model import init_tiny
from protos.config import TrainerConfig
from protos.records import Array, FinishReason, Sample, TrajectoryGroup, VersionSpan
from trainer_service.torch_backend import TorchBackend
from trainer_service.trainer import Trainer

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(init_tiny(tmp_path_factory.mktemp("tiny")))


def _group(index: int, version: int, rewards=(0.0, 1.0)) -> TrajectoryGroup:
    samples = [
        Sample(
            Array.from_numpy(np.array([5, 6, 7], np.int32)),
            Array.from_numpy(np.full(3, -4.0, np.float32)),
            [VersionSpan(version, 0, 3)],
            FinishReason.LENGTH,
            reward,
        )
        for reward in rewards
    ]
    return TrajectoryGroup(
        f"g{index}", f"p{index}", Array.from_numpy(np.array([1, 4, 5], np.int32)), samples, "test", index, version, 0.0
    )


def test_trainer_drops_groups_beyond_staleness_bound_and_counts_them(model_dir):
    trainer = Trainer(TorchBackend(model_dir, TrainerConfig(geo_mask=None)), max_staleness=1, policy_version=3)
    values = trainer.step([_group(0, 3), _group(1, 2), _group(2, 1)])  # staleness 0, 1, 2
    assert values["staleness_max"] == 2.0
    assert trainer.totals.stale_dropped == 2  # the two samples of the group at staleness 2
    assert trainer.totals.samples_trained == 4
    assert trainer.policy_version == 4 and values["skipped"] == 0.0
    assert trainer.totals.staleness_counts == {0: 1, 1: 1, 2: 1}


def test_trainer_does_not_advance_version_when_every_group_is_stale(model_dir):
    trainer = Trainer(TorchBackend(model_dir, TrainerConfig()), max_staleness=0, policy_version=5)
    values = trainer.step([_group(0, 3)])
    assert values["skipped"] == 1.0 and trainer.policy_version == 5
    assert trainer.totals.stale_dropped == 2 and trainer.totals.samples_trained == 0


def test_non_finite_loss_skips_the_step_and_keeps_weights(model_dir):
    backend = TorchBackend(model_dir, TrainerConfig(geo_mask=None))
    trainer = Trainer(backend, max_staleness=1, policy_version=0)
    before = {k: v.clone() for k, v in backend.model.state_dict().items()}
    values = trainer.step([_group(0, 0, rewards=(float("nan"), 1.0))])
    assert values["skipped"] == 1.0 and trainer.policy_version == 0
    assert all((before[k] == v).all() for k, v in backend.model.state_dict().items())


def test_ledger_skips_groups_seen_before_or_twice_in_one_read(model_dir):
    from synthetic import make_group

    trainer = Trainer(TorchBackend(model_dir, TrainerConfig(geo_mask=None)), max_staleness=4, policy_version=0)
    trainer.step(trainer.filter_new([make_group(0), make_group(1)]))
    assert trainer.ledger == {"g0": "trained", "g1": "trained"}
    # g1 redelivered after a crash, g2 pushed twice by a retrying coordinator: each trained once
    new = trainer.filter_new([make_group(1), make_group(2), make_group(2)])
    assert [g.group_id for g in new] == ["g2"] and trainer.totals.duplicates_skipped == 2
    with pytest.raises(ValueError, match="ledger"):
        trainer.step([make_group(0)])


def test_micro_batches_give_the_same_step_as_one_batch(model_dir):

    from synthetic import make_group

    from trainer_service.batch import build_batch, split_micro_batches

    groups = [make_group(i, seed=7) for i in range(4)]
    batch = build_batch(groups)
    micro = split_micro_batches(batch, max_tokens=40)
    assert len(micro) > 2 and sum(len(m.advantages_B) for m in micro) == len(batch.advantages_B)
    assert all(m.input_ids_BT.numel() <= 40 or len(m.advantages_B) == 1 for m in micro)
    results = {}
    for agg in ("token-mean", "seq-mean-token-mean"):
        for budget in (0, 40):
            backend = TorchBackend(model_dir, TrainerConfig(geo_mask=None, loss_agg=agg, micro_batch_tokens=budget))
            values = backend.train_step(batch)
            # gradients, not weights: Adam's first step amplifies 1e-9 differences of near-zero gradients
            results[agg, budget] = (values, [p.grad.clone() for p in backend.model.parameters() if p.grad is not None])
        (whole, whole_grads), (split, split_grads) = results[agg, 0], results[agg, 40]
        assert split["micro_batches"] > 2 and whole["micro_batches"] == 1
        assert split["loss"] == pytest.approx(whole["loss"], abs=1e-6)
        assert split["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-5)
        assert len(whole_grads) == len(split_grads) > 0
        assert max((a - b).abs().max().item() for a, b in zip(whole_grads, split_grads, strict=True)) < 1e-6


def _with_rollout(group: TrajectoryGroup, routes_BTLK, logprobs_BT, attach_routes: bool) -> TrajectoryGroup:
    """The group as a rollout engine would return it: its own logprobs, and its routes when it has them."""
    prompt_len = len(group.prompt_token_ids.to_numpy())
    samples = []
    for row, sample in enumerate(group.samples):
        length = len(sample.response_token_ids.to_numpy())
        rollout = logprobs_BT[row, prompt_len - 1 : prompt_len - 1 + length].numpy().astype(np.float32)
        routes = routes_BTLK[row, : prompt_len + length - 1].numpy().astype(np.int32)  # vLLM's layout
        samples.append(
            Sample(
                sample.response_token_ids,
                Array.from_numpy(rollout),
                sample.version_spans,
                sample.finish_reason,
                sample.reward,
                routed_experts=Array.from_numpy(routes) if attach_routes else None,
            )
        )
    return TrajectoryGroup(
        group.group_id,
        group.prompt_id,
        group.prompt_token_ids,
        samples,
        group.data_source,
        group.admission_index,
        group.admitted_at_version,
        group.created_s,
    )


def test_trainer_replays_rollout_routes_so_its_logprobs_match_the_rollouts(model_dir):
    import torch
    from router_perturbation import perturb_unused_experts

    from trainer_service.batch import build_batch
    from trainer_service.routing_replay import record_routes
    from trainer_service.torch_backend import token_logprobs

    # Short rows so some experts stay unused (the perturbation below needs them).
    group = _group(0, version=0, rewards=(0.0, 1.0))
    results = {}
    for attach_routes in (True, False):
        backend = TorchBackend(model_dir, TrainerConfig(geo_mask=None))
        batch = build_batch([group])
        with torch.no_grad(), record_routes(backend.model) as recorder:  # the "rollout" engine's routing
            logprobs = token_logprobs(backend.model, batch.input_ids_BT, batch.attention_mask_BT, 1.0)
        routes = recorder.routes(*batch.input_ids_BT.shape)
        # The trainer's router drifts from the rollout's: natural routing now picks other experts.
        perturb_unused_experts([layer.mlp.gate.weight for layer in backend.model.model.layers], routes)
        trainer = Trainer(backend, max_staleness=1)
        results[attach_routes] = trainer.step([_with_rollout(group, routes, logprobs, attach_routes)])
    assert results[True]["r3_replayed"] == 1.0 and results[False]["r3_replayed"] == 0.0
    assert results[True]["mean_abs_logprob_diff"] < 1e-5  # replayed: the rollout's own logprobs back
    assert results[False]["mean_abs_logprob_diff"] > 1e-3


def test_mini_batches_take_several_optimizer_steps_against_one_pi_old_and_publish_once(model_dir):
    import torch
    from synthetic import make_group

    groups = [make_group(i, seed=9) for i in range(4)]
    one = Trainer(TorchBackend(model_dir, TrainerConfig(geo_mask=None)), max_staleness=1)
    two = Trainer(TorchBackend(model_dir, TrainerConfig(geo_mask=None)), max_staleness=1, mini_batches=2)
    start = {k: v.clone() for k, v in two.backend.model.state_dict().items()}
    values_one, values_two = one.step(groups), two.step(groups)
    assert values_two["mini_batches"] == 2 and two.policy_version == one.policy_version == 1
    assert two.backend.optimizer.state[next(iter(two.backend.model.parameters()))]["step"] == 2  # two updates
    moved_one = sum((v - start[k]).abs().sum() for k, v in one.backend.model.state_dict().items())
    moved_two = sum((v - start[k]).abs().sum() for k, v in two.backend.model.state_dict().items())
    assert moved_two > moved_one  # the second update went further from the start
    # The second mini-batch's ratio is against the step-start policy: it is not 1 everywhere any more.
    assert values_two["clip_frac"] > values_one["clip_frac"] == 0.0
    with pytest.raises(ValueError, match="mini_batches=3"):
        Trainer(TorchBackend(model_dir, TrainerConfig(geo_mask=None)), max_staleness=1, mini_batches=3).step(groups)
    assert torch.isfinite(torch.tensor(values_two["loss"]))


def test_replay_mismatch_figures_show_what_r3_removes_on_on_policy_rows(model_dir):
    import torch
    from router_perturbation import perturb_unused_experts

    from trainer_service.batch import build_batch
    from trainer_service.routing_replay import record_routes
    from trainer_service.torch_backend import token_logprobs

    group = _group(0, version=0, rewards=(0.0, 1.0))
    backend = TorchBackend(model_dir, TrainerConfig(geo_mask=None))
    batch = build_batch([group])
    with torch.no_grad(), record_routes(backend.model) as recorder:
        logprobs = token_logprobs(backend.model, batch.input_ids_BT, batch.attention_mask_BT, 1.0)
    routes = recorder.routes(*batch.input_ids_BT.shape)
    perturb_unused_experts([layer.mlp.gate.weight for layer in backend.model.model.layers], routes)
    trainer = Trainer(backend, max_staleness=1, measure_replay_mismatch=True)
    values = trainer.step([_with_rollout(group, routes, logprobs, True)])
    assert values["on_policy_tokens"] == 6  # both samples are at the trainer's version: on-policy
    assert values["on_policy_abs_logprob_diff_r3"] < 1e-5 < 1e-3 < values["on_policy_abs_logprob_diff_natural"]
    stale = trainer.step([_with_rollout(_group(1, version=0), routes, logprobs, True)])  # now one version behind
    assert "on_policy_tokens" not in stale
