"""Tests for trainer_service.losses against hand-computed values."""

import math

import pytest
import torch

from trainer_service.losses import (
    PolicyLossConfig,
    compute_advantages,
    policy_loss,
)

pytestmark = pytest.mark.unit

NO_CORRECTION = PolicyLossConfig(geo_mask=None)


def _t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def _log(rows):
    return torch.log(_t(rows))


def _run(logprobs, old, rollout, adv, mask, cfg):
    logprobs = logprobs.clone().requires_grad_(True)
    loss, metrics = policy_loss(logprobs, old, rollout, _t(adv), _t(mask), cfg)
    loss.backward()
    return loss, metrics, logprobs.grad


def _assert_close(actual, expected, tol=1e-5):
    assert torch.allclose(actual, _t(expected), atol=tol), (actual, expected)


# ---------------------------------------------------------------- advantages


def test_compute_advantages_divides_by_unbiased_group_std():
    adv = compute_advantages(_t([0.0, 1.0, 2.0, 3.0, 3.0, 6.0]), 3, eps=0.0)
    # group 2: mean 4, unbiased std sqrt((1 + 1 + 4) / 2) = sqrt(3)
    _assert_close(adv, [-1.0, 0.0, 1.0, -0.57735027, -0.57735027, 1.15470054])


def test_compute_advantages_without_std_only_centers():
    adv = compute_advantages(_t([0.0, 1.0, 2.0, 3.0, 3.0, 6.0]), 3, norm_std=False)
    _assert_close(adv, [-1.0, 0.0, 1.0, -1.0, -1.0, 2.0])


def test_compute_advantages_constant_group_gives_zero():
    adv = compute_advantages(_t([1.0, 0.0, 2.0, 2.0]), 2)
    # group 1: +-0.5 / (sqrt(0.5) + 1e-6)
    _assert_close(adv, [0.70710578, -0.70710578, 0.0, 0.0])


def test_compute_advantages_group_size_one_gives_zero():
    _assert_close(compute_advantages(_t([3.0, -1.0]), 1), [0.0, 0.0])


@pytest.mark.parametrize("n, group_size", [(5, 2), (4, 0)])
def test_compute_advantages_rejects_bad_group_size(n, group_size):
    with pytest.raises(ValueError, match="group_size"):
        compute_advantages(torch.zeros(n), group_size)


# ------------------------------------------------------------- PPO clipping


def test_ppo_clips_high_for_positive_and_low_for_negative_advantage():
    logprobs = _log([[1.5, 1.0, 0.5], [1.5, 1.0, 0.5]])
    zeros = torch.zeros(2, 3)
    loss, metrics, grad = _run(logprobs, zeros, zeros, [1.0, -1.0], [[1] * 3] * 2, NO_CORRECTION)
    # per token: A=+1 -> [-1.28, -1.0, -0.5]; A=-1 -> [1.5, 1.0, 0.8]; sum 0.52
    assert loss.item() == pytest.approx(0.52 / 6, abs=1e-6)
    assert metrics["pg_loss"] == pytest.approx(0.08666667, abs=1e-6)
    assert metrics["clip_frac"] == pytest.approx(2 / 6, abs=1e-6)
    # clipped tokens get no gradient; others -A * ratio / 6
    _assert_close(grad, [[0.0, -1 / 6, -0.5 / 6], [1.5 / 6, 1 / 6, 0.0]])


def test_ppo_clip_frac_zero_inside_trust_region():
    logprobs = _log([[1.1, 0.9, 1.0], [1.2, 0.85, 1.0]])
    zeros = torch.zeros(2, 3)
    _, metrics, _ = _run(logprobs, zeros, zeros, [1.0, -1.0], [[1] * 3] * 2, NO_CORRECTION)
    assert metrics["clip_frac"] == 0.0


# -------------------------------------------------------------- aggregation

# ratios inside the clip range; A=[2, -1]; token losses [-2.2, -1.8] and [1.2]
AGG_LOGPROBS = [[1.1, 0.9, 1.0], [1.2, 1.0, 1.0]]
AGG_MASK = [[1, 1, 0], [1, 0, 0]]


@pytest.mark.parametrize(
    "loss_agg, expected",
    [
        ("token-mean", -2.8 / 3),  # (-2.2 - 1.8 + 1.2) / 3
        ("seq-mean-token-mean", -0.4),  # mean(-4.0 / 2, 1.2 / 1)
        ("seq-mean-token-sum", -1.4),  # mean(-4.0, 1.2)
    ],
)
def test_loss_aggregation_modes(loss_agg, expected):
    cfg = PolicyLossConfig(geo_mask=None, loss_agg=loss_agg)
    zeros = torch.zeros(2, 3)
    loss, metrics, _ = _run(_log(AGG_LOGPROBS), zeros, zeros, [2.0, -1.0], AGG_MASK, cfg)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert metrics["num_tokens"] == 3.0


@pytest.mark.parametrize(
    "loss_agg, expected",
    [
        ("seq-mean-token-mean", -0.4),
        ("seq-mean-token-sum", -1.4),
    ],
)
def test_seq_mean_aggregation_excludes_sequences_without_tokens(loss_agg, expected):
    cfg = PolicyLossConfig(geo_mask=None, loss_agg=loss_agg)
    zeros = torch.zeros(3, 3)
    logprobs = _log(AGG_LOGPROBS + [[1.0, 1.0, 1.0]])
    loss, _, _ = _run(logprobs, zeros, zeros, [2.0, -1.0, 5.0], AGG_MASK + [[0, 0, 0]], cfg)
    assert loss.item() == pytest.approx(expected, abs=1e-6)


# ------------------------------------------------------ off-policy correction


def test_geo_mask_drops_sequence_outside_bounds_and_keeps_denominator():
    log_rho = _t([[0.02, -0.02, 0.0], [0.03, 0.03, 0.03], [-0.05, -0.01, 0.0]])
    zeros = torch.zeros(3, 3)
    cfg = PolicyLossConfig(geo_mask=(0.99, 1.01))
    loss, metrics, grad = _run(zeros, zeros, -log_rho, [1.0, 1.0, 1.0], [[1] * 3] * 3, cfg)
    # geo means: exp(0)=1 keep, exp(0.03)=1.0305 over, exp(-0.02)=0.9802 under;
    # only seq 0 survives (3 tokens of loss -1) but all 9 tokens count.
    assert loss.item() == pytest.approx(-3 / 9, abs=1e-6)
    _assert_close(grad, [[-1 / 9] * 3, [0.0] * 3, [0.0] * 3])
    assert metrics["geo_mask_masked_ratio"] == pytest.approx(2 / 3)
    assert metrics["geo_mask_over_high_ratio"] == pytest.approx(1 / 3)
    assert metrics["geo_mask_under_low_ratio"] == pytest.approx(1 / 3)


def test_geo_mask_uses_only_response_tokens_in_geometric_mean():
    # masked token has a huge log_rho that would otherwise reject the sequence
    log_rho = _t([[0.005, 5.0, 0.0], [0.0, 0.0, 0.0]])
    zeros = torch.zeros(2, 3)
    _, metrics, grad = _run(zeros, zeros, -log_rho, [1.0, 1.0], [[1, 0, 0], [1, 1, 1]], PolicyLossConfig())
    assert metrics["geo_mask_masked_ratio"] == 0.0
    _assert_close(grad, [[-0.25, 0.0, 0.0], [-0.25, -0.25, -0.25]])


def test_token_tis_multiplies_loss_by_capped_ratio():
    zeros = torch.zeros(2, 3)
    log_rho = torch.log(_t([[3.0, 0.5, 1.0], [1.0, 1.0, 1.0]]))
    cfg = PolicyLossConfig(geo_mask=None, token_tis_cap=2.0)
    loss, _, grad = _run(zeros, zeros, -log_rho, [1.0, -1.0], [[1] * 3] * 2, cfg)
    # weights [2, 0.5, 1] on seq 0: (-2 - 0.5 - 1 + 3) / 6
    assert loss.item() == pytest.approx(-0.5 / 6, abs=1e-6)
    _assert_close(grad, [[-2 / 6, -0.5 / 6, -1 / 6], [1 / 6, 1 / 6, 1 / 6]])


def test_icepop_zeroes_tokens_with_ratio_outside_bounds():
    zeros = torch.zeros(2, 3)
    log_rho = torch.log(_t([[3.0, 0.25, 1.0], [1.5, 1.0, 1.0]]))
    cfg = PolicyLossConfig(geo_mask=None, icepop=(0.5, 2.0))
    loss, metrics, grad = _run(zeros, zeros, -log_rho, [1.0, 1.0], [[1] * 3] * 2, cfg)
    assert loss.item() == pytest.approx(-4 / 6, abs=1e-6)
    assert metrics["icepop_masked_token_ratio"] == pytest.approx(2 / 6)
    _assert_close(grad, [[0.0, 0.0, -1 / 6], [-1 / 6, -1 / 6, -1 / 6]])


def test_mean_abs_logprob_diff_and_approx_kl_over_response_tokens():
    log_rho = _t([[0.1, -0.2, 5.0], [0.0, 0.3, -0.1]])
    zeros = torch.zeros(2, 3)
    _, metrics, _ = _run(zeros, zeros, -log_rho, [1.0, 1.0], [[1, 1, 0], [1, 1, 1]], NO_CORRECTION)
    assert metrics["mean_abs_logprob_diff"] == pytest.approx(0.7 / 5, abs=1e-6)
    # k3 = e^x - 1 - x: 0.005170918 + 0.018730753 + 0 + 0.049858808 + 0.004837418
    assert metrics["approx_kl"] == pytest.approx(0.078597897 / 5, abs=1e-6)


# ------------------------------------------------------------------ robustness


def test_gradient_flows_only_through_logprobs():
    logprobs = torch.zeros(2, 3, requires_grad=True)
    old = torch.full((2, 3), -0.1, requires_grad=True)
    rollout = torch.full((2, 3), -0.1, requires_grad=True)
    adv = torch.tensor([1.0, -1.0], requires_grad=True)
    cfg = PolicyLossConfig(token_tis_cap=2.0, icepop=(0.5, 2.0))
    loss, _ = policy_loss(logprobs, old, rollout, adv, torch.ones(2, 3), cfg)
    loss.backward()
    assert logprobs.grad is not None and logprobs.grad.abs().sum() > 0
    assert old.grad is None and rollout.grad is None and adv.grad is None


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_all_zero_mask_gives_finite_zero_loss_with_grad(loss_agg):
    cfg = PolicyLossConfig(loss_agg=loss_agg, token_tis_cap=2.0, icepop=(0.5, 2.0))
    zeros = torch.zeros(2, 3)
    loss, metrics, grad = _run(zeros, zeros - 1.0, zeros, [1.0, -1.0], [[0] * 3] * 2, cfg)
    assert loss.item() == 0.0
    _assert_close(grad, [[0.0] * 3] * 2)
    assert all(math.isfinite(v) for v in metrics.values())
    assert metrics["num_tokens"] == 0.0


def test_masked_padding_with_inf_logprobs_stays_finite():
    old = _t([[0.0, 0.0, -math.inf], [0.0, -math.inf, -math.inf]])
    rollout = _t([[0.0, 0.0, 0.0], [0.0, -math.inf, 0.0]])
    cfg = PolicyLossConfig(token_tis_cap=2.0, icepop=(0.5, 2.0))
    loss, metrics, grad = _run(torch.zeros(2, 3), old, rollout, [1.0, 1.0], AGG_MASK, cfg)
    assert loss.item() == pytest.approx(-1.0, abs=1e-6)
    assert torch.isfinite(grad).all()
    assert all(math.isfinite(v) for v in metrics.values())


def test_policy_loss_rejects_mismatched_advantages_shape():
    zeros = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="advantages_B"):
        policy_loss(zeros, zeros, zeros, torch.zeros(3), zeros, NO_CORRECTION)


# ------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"clip_low": 1.0}, "clip_low"),
        ({"clip_low": -0.1}, "clip_low"),
        ({"clip_high": -0.1}, "clip_high"),
        ({"loss_agg": "sum"}, "loss_agg"),
        ({"geo_mask": (1.01, 0.99)}, "geo_mask"),
        ({"geo_mask": (0.0, 1.01)}, "geo_mask"),
        ({"token_tis_cap": 0.0}, "token_tis_cap"),
        ({"icepop": (2.0, 0.5)}, "icepop"),
        ({"icepop": (-1.0, 2.0)}, "icepop"),
    ],
)
def test_policy_loss_config_validation_names_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PolicyLossConfig(**kwargs)


def test_policy_loss_config_defaults_are_valid_and_frozen():
    cfg = PolicyLossConfig()
    assert (cfg.clip_low, cfg.clip_high, cfg.loss_agg) == (0.2, 0.28, "token-mean")
    assert cfg.geo_mask == (0.99, 1.01)
    with pytest.raises(AttributeError):
        cfg.clip_low = 0.3
