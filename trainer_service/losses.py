"""Advantage estimation and the clipped policy-gradient loss with its off-policy corrections.

Pure torch: no I/O and no imports from the rest of fleetrl.

Shape legend (suffix on tensor names):
    _B   [batch]            one value per sequence (sample)
    _G   [groups]           one value per prompt group (batch // group_size)
    _BT  [batch, tokens]    one value per response token position

Policies involved in ``policy_loss``:
    pi_theta  current trainer policy            -> ``logprobs_BT`` (carries grad)
    pi_old    trainer policy at rollout weights -> ``old_logprobs_BT``
    mu        inference-engine (rollout) policy -> ``rollout_logprobs_BT``
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")

# Bound on |log pi_theta - log pi_old| before exp(): keeps exp() finite so a
# single wild token cannot turn the loss (or its gradient) into inf/NaN.
_MAX_LOG_RATIO = 20.0


def _group_view(rewards_B: torch.Tensor, group_size: int) -> torch.Tensor:
    """Reshapes flat rewards into [groups, group_size] after validation.

    Args:
        rewards_B: 1-D rewards, laid out as consecutive groups.
        group_size: Number of samples per prompt group.

    Returns:
        Tensor of shape [G, group_size].

    Raises:
        ValueError: If group_size < 1, rewards_B is not 1-D, or its length is
            not divisible by group_size.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards_B.dim() != 1:
        raise ValueError(f"rewards_B must be 1-D, got shape {tuple(rewards_B.shape)}")
    if rewards_B.numel() % group_size != 0:
        raise ValueError(f"rewards_B length {rewards_B.numel()} is not divisible by group_size {group_size}")
    return rewards_B.reshape(-1, group_size)


def compute_advantages(
    rewards_B: torch.Tensor,
    group_size: int,
    norm_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Computes GRPO group-relative advantages.

    ``(r - mean_group) / (std_group + eps)`` when ``norm_std`` else
    ``r - mean_group``. The std is torch.std's default *unbiased* (Bessel,
    N - 1) estimator, matching DeepSeekMath GRPO and verl. A group of size 1
    has an undefined unbiased std; it is treated as 0 (advantage 0).

    Args:
        rewards_B: Scalar reward per sample, consecutive groups of
            ``group_size`` samples that share a prompt.
        group_size: Samples per group.
        norm_std: Divide by the group std (GRPO) or only center (Dr. GRPO).
        eps: Added to the std to avoid division by zero.

    Returns:
        advantages_B with the same shape as rewards_B, float dtype.

    Raises:
        ValueError: If group_size < 1 or len(rewards_B) % group_size != 0.
    """
    groups = _group_view(rewards_B, group_size)
    if not torch.is_floating_point(groups):
        groups = groups.float()
    centered = groups - groups.mean(dim=1, keepdim=True)
    if norm_std:
        if group_size > 1:
            std = groups.std(dim=1, keepdim=True)
        else:
            std = torch.zeros_like(centered)
        centered = centered / (std + eps)
    return centered.reshape(-1)


def _check_range_pair(name: str, value: tuple[float, float] | None, min_low: float) -> None:
    """Validates an optional (low, high) bound pair; raises naming ``name``."""
    if value is None:
        return
    if not isinstance(value, tuple) or len(value) != 2:
        raise ValueError(f"{name} must be a (low, high) tuple or None, got {value!r}")
    low, high = value
    if not low >= min_low or not high >= low:
        raise ValueError(f"{name} must satisfy {min_low} <= low <= high, got {value!r}")


@dataclass(frozen=True)
class PolicyLossConfig:
    """Configuration of ``policy_loss``.

    Attributes:
        clip_low: PPO lower clip, ratio >= 1 - clip_low. In [0, 1).
        clip_high: PPO upper clip, ratio <= 1 + clip_high (DAPO clip-higher).
        loss_agg: One of LOSS_AGG_MODES.
        geo_mask: (low, high) bounds on the per-sequence geometric mean of
            pi_old / mu; sequences outside are rejected. None disables.
        token_tis_cap: Cap for truncated token-level importance sampling
            weights min(pi_old / mu, cap). None disables.
        icepop: (a, b) bounds on the token ratio pi_old / mu; tokens outside
            are zeroed (IcePop). None disables.
    """

    clip_low: float = 0.2
    clip_high: float = 0.28
    loss_agg: str = "token-mean"
    geo_mask: tuple[float, float] | None = (0.99, 1.01)
    token_tis_cap: float | None = None
    icepop: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        """Validates fields; each ValueError message starts with the field name."""
        if not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"clip_low must be in [0, 1), got {self.clip_low}")
        if not self.clip_high >= 0.0:
            raise ValueError(f"clip_high must be >= 0, got {self.clip_high}")
        if self.loss_agg not in LOSS_AGG_MODES:
            raise ValueError(f"loss_agg must be one of {LOSS_AGG_MODES}, got {self.loss_agg!r}")
        # A ratio bound of 0 would be meaningless for the geometric mean.
        _check_range_pair("geo_mask", self.geo_mask, min_low=1e-12)
        if self.token_tis_cap is not None and not self.token_tis_cap > 0.0:
            raise ValueError(f"token_tis_cap must be > 0 or None, got {self.token_tis_cap}")
        _check_range_pair("icepop", self.icepop, min_low=0.0)


def _validate_policy_inputs(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    rollout_logprobs_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    loss_mask_BT: torch.Tensor,
) -> None:
    """Raises ValueError naming the first argument whose shape is wrong."""
    if logprobs_BT.dim() != 2:
        raise ValueError(f"logprobs_BT must be 2-D, got shape {tuple(logprobs_BT.shape)}")
    shape = logprobs_BT.shape
    for name, t in (
        ("old_logprobs_BT", old_logprobs_BT),
        ("rollout_logprobs_BT", rollout_logprobs_BT),
        ("loss_mask_BT", loss_mask_BT),
    ):
        if t.shape != shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != logprobs_BT shape {tuple(shape)}")
    if advantages_B.shape != shape[:1]:
        raise ValueError(f"advantages_B shape {tuple(advantages_B.shape)} != ({shape[0]},)")


def _geo_sequence_mask(
    log_rho_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    bounds: tuple[float, float] | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Rejects whole sequences whose geometric-mean ratio leaves ``bounds``.

    Args:
        log_rho_BT: Detached log(pi_old / mu), 0 outside the loss mask.
        mask_BT: Float loss mask.
        bounds: (low, high) or None.

    Returns:
        keep_B (float 0/1) and the geo_mask_* ratio metrics, measured over
        sequences with at least one response token.
    """
    has_tokens_B = mask_BT.sum(dim=1) > 0
    n_seq = max(1, int(has_tokens_B.sum().item()))
    if bounds is None:
        keep_B = torch.ones_like(mask_BT[:, 0])
        zero = {"geo_mask_masked_ratio": 0.0, "geo_mask_over_high_ratio": 0.0, "geo_mask_under_low_ratio": 0.0}
        return keep_B, zero
    low, high = bounds
    mean_log_B = (log_rho_BT * mask_BT).sum(dim=1) / mask_BT.sum(dim=1).clamp(min=1.0)
    geo_B = torch.exp(mean_log_B)
    over_B = (geo_B > high) & has_tokens_B
    under_B = (geo_B < low) & has_tokens_B
    keep_B = (~(over_B | under_B)).to(mask_BT.dtype)
    metrics = {
        "geo_mask_masked_ratio": float((over_B | under_B).sum().item()) / n_seq,
        "geo_mask_over_high_ratio": float(over_B.sum().item()) / n_seq,
        "geo_mask_under_low_ratio": float(under_B.sum().item()) / n_seq,
    }
    return keep_B, metrics


@torch.no_grad()
def _off_policy_correction(
    old_logprobs_BT: torch.Tensor,
    rollout_logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    cfg: PolicyLossConfig,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Builds the detached correction terms for rho = pi_old / mu.

    Args:
        old_logprobs_BT: Token log-probs under pi_old.
        rollout_logprobs_BT: Token log-probs under the rollout policy mu.
        mask_BT: Original float loss mask.
        cfg: Loss configuration (geo_mask, token_tis_cap, icepop).

    Returns:
        eff_mask_BT (loss mask x geo keep x icepop keep), tis_BT (per-token
        IS weight, 1 where TIS is off) and the mismatch metrics (everything
        except clip_frac and pg_loss).
    """
    on_BT = mask_BT > 0
    num_tokens = max(1.0, float(mask_BT.sum().item()))
    # where() keeps padding garbage (e.g. -inf log-probs) out of every term.
    log_rho_BT = torch.where(on_BT, old_logprobs_BT - rollout_logprobs_BT, torch.zeros_like(mask_BT)).to(mask_BT.dtype)
    rho_BT = torch.exp(log_rho_BT)
    keep_B, metrics = _geo_sequence_mask(log_rho_BT, mask_BT, cfg.geo_mask)
    eff_mask_BT = mask_BT * keep_B.unsqueeze(1)
    icepop_out_BT = torch.zeros_like(on_BT)
    if cfg.icepop is not None:
        icepop_out_BT = ((rho_BT < cfg.icepop[0]) | (rho_BT > cfg.icepop[1])) & on_BT
        eff_mask_BT = eff_mask_BT * (~icepop_out_BT).to(mask_BT.dtype)
    tis_BT = torch.ones_like(rho_BT)
    if cfg.token_tis_cap is not None:
        tis_BT = rho_BT.clamp(max=cfg.token_tis_cap)
    k3_BT = rho_BT - 1.0 - log_rho_BT
    metrics["icepop_masked_token_ratio"] = float(icepop_out_BT.sum().item()) / num_tokens
    abs_diff = float((log_rho_BT.abs() * mask_BT).sum().item())
    metrics["mean_abs_logprob_diff"] = abs_diff / num_tokens
    metrics["approx_kl"] = float((k3_BT * mask_BT).sum().item()) / num_tokens
    metrics["num_tokens"] = float(mask_BT.sum().item())
    return eff_mask_BT, tis_BT, metrics


def _aggregate(
    loss_BT: torch.Tensor,
    eff_mask_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    loss_agg: str,
) -> torch.Tensor:
    """Reduces per-token losses to a scalar.

    Numerators use the effective mask (loss mask x rejection masks), but all
    token/sequence counts in denominators come from the ORIGINAL loss mask, so
    rejected tokens shrink the gradient instead of re-weighting survivors
    (SkyRL behaviour). Sequences with zero response tokens are excluded from
    both sequence-mean modes so that batch padding rows do not dilute them.

    Args:
        loss_BT: Per-token loss (already TIS-weighted).
        eff_mask_BT: Effective float mask.
        mask_BT: Original float loss mask.
        loss_agg: One of LOSS_AGG_MODES.

    Returns:
        Scalar loss; exactly 0 (with grad) when mask_BT is all zero.
    """
    # where() rather than multiply: a masked-out inf/NaN must not leak through.
    masked_BT = torch.where(eff_mask_BT > 0, loss_BT * eff_mask_BT, torch.zeros_like(loss_BT))
    if loss_agg == "token-mean":
        return masked_BT.sum() / mask_BT.sum().clamp(min=1.0)
    seq_sum_B = masked_BT.sum(dim=1)
    tokens_B = mask_BT.sum(dim=1)
    valid_B = (tokens_B > 0).to(loss_BT.dtype)
    if loss_agg == "seq-mean-token-mean":
        seq_loss_B = seq_sum_B / tokens_B.clamp(min=1.0)
    elif loss_agg == "seq-mean-token-sum":
        seq_loss_B = seq_sum_B
    else:
        raise ValueError(f"loss_agg must be one of {LOSS_AGG_MODES}, got {loss_agg!r}")
    return (seq_loss_B * valid_B).sum() / valid_B.sum().clamp(min=1.0)


def loss_denominator(loss_mask_BT: torch.Tensor, loss_agg: str) -> float:
    """The count ``policy_loss`` divides by: response tokens (token-mean) or non-empty sequences.

    Gradient accumulation weights each micro-batch's loss by ``its denominator / the step's`` so the
    sum over micro-batches equals the loss of the whole step in one batch.
    """
    if loss_agg == "token-mean":
        return float(loss_mask_BT.sum().clamp(min=1.0))
    if loss_agg in LOSS_AGG_MODES:
        return float((loss_mask_BT.sum(dim=1) > 0).sum().clamp(min=1))
    raise ValueError(f"loss_agg must be one of {LOSS_AGG_MODES}, got {loss_agg!r}")


def policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    rollout_logprobs_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    loss_mask_BT: torch.Tensor,
    cfg: PolicyLossConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO clipped surrogate with rollout off-policy correction.

    The PPO ratio is pi_theta / pi_old; the off-policy correction uses
    rho = pi_old / mu (detached) via the geometric sequence mask, truncated
    token IS and IcePop, all combined multiplicatively with the loss mask.
    Gradients flow only through ``logprobs_BT``.

    Metrics: clip_frac, geo_mask_{masked,over_high,under_low}_ratio,
    icepop_masked_token_ratio, mean_abs_logprob_diff, approx_kl, pg_loss,
    num_tokens. approx_kl is k3 = (rho - 1) - log(rho) averaged over response
    tokens: tokens are sampled from mu, so it is an unbiased, non-negative
    estimate of KL(mu || pi_old).

    Args:
        logprobs_BT: Token log-probs under pi_theta (requires grad).
        old_logprobs_BT: Token log-probs under pi_old.
        rollout_logprobs_BT: Token log-probs reported by the rollout engine.
        advantages_B: One advantage per sequence, broadcast over its tokens.
        loss_mask_BT: 1 for response tokens that enter the loss, else 0.
        cfg: Loss configuration.

    Returns:
        (loss, metrics): scalar loss tensor and a dict of python floats.

    Raises:
        ValueError: On mismatched input shapes.
    """
    _validate_policy_inputs(logprobs_BT, old_logprobs_BT, rollout_logprobs_BT, advantages_B, loss_mask_BT)
    mask_BT = loss_mask_BT.to(logprobs_BT.dtype)
    on_BT = mask_BT > 0
    num_tokens = mask_BT.sum().clamp(min=1.0)
    # where() keeps padding garbage (e.g. -inf log-probs) out of the ratio.
    log_ratio_BT = torch.where(on_BT, logprobs_BT - old_logprobs_BT.detach(), torch.zeros_like(mask_BT))
    ratio_BT = torch.exp(log_ratio_BT.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    adv_BT = advantages_B.detach().to(ratio_BT.dtype).unsqueeze(1)
    unclipped_BT = -adv_BT * ratio_BT
    clipped_BT = -adv_BT * ratio_BT.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    loss_BT = torch.maximum(unclipped_BT, clipped_BT)

    eff_mask_BT, tis_BT, metrics = _off_policy_correction(old_logprobs_BT, rollout_logprobs_BT, mask_BT, cfg)
    with torch.no_grad():
        clip_frac = ((clipped_BT > unclipped_BT) & on_BT).sum() / num_tokens
    loss = _aggregate(loss_BT * tis_BT, eff_mask_BT, mask_BT, cfg.loss_agg)
    metrics["clip_frac"] = float(clip_frac.item())
    metrics["pg_loss"] = float(loss.detach().item())
    return loss, metrics
