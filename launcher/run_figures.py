"""The figures of a run's summary and its step lines that are plain arithmetic over the trainer's step reports, the
coordinator's rates and the rollout servers' version reports (the launchers' ``summary.json``)."""

from __future__ import annotations

import statistics


def speed_figures(
    steps: list[dict], rollout_rates: list[float], updates: dict[tuple[str, int], tuple[float, float]]
) -> dict:
    """Medians of the run's speed figures (steps after the first, and updates after each server's first: both pay
    start-up costs). ``updates``: (server, version) -> (update_s, paused_s) of each weight update seen."""
    later = steps[1:] or steps
    firsts = {server: min(v for s, v in updates if s == server) for server, _ in updates}
    later_updates = [d for (server, version), d in updates.items() if version > firsts[server]] or list(
        updates.values()
    )
    r3 = [s["on_policy_abs_logprob_diff_r3"] for s in steps if "on_policy_abs_logprob_diff_r3" in s]
    natural = [s["on_policy_abs_logprob_diff_natural"] for s in steps if "on_policy_abs_logprob_diff_natural" in s]
    return {
        "rollout_tokens_per_s": median([rate for rate in rollout_rates if rate > 0]),
        "train_s_per_step": median([s.get("train_s", 0.0) for s in later]),
        "step_s": median([s.get("step_s", 0.0) for s in later]),
        "publish_s": median([s.get("publish_s", 0.0) for s in later]),
        "weight_update_s": median([update_s for update_s, _ in later_updates]),
        "weight_update_paused_s": median([paused_s for _, paused_s in later_updates]),
        "on_policy_abs_logprob_diff_r3": sum(r3) / len(r3) if r3 else None,
        "on_policy_abs_logprob_diff_natural": sum(natural) / len(natural) if natural else None,
    }


def replay_figures(step: dict) -> str:
    """The step line's R3 part, when the trainer measured it."""
    if "on_policy_abs_logprob_diff_r3" not in step:
        return ""
    return (
        f" | on-policy |dlogp| R3 {step['on_policy_abs_logprob_diff_r3']:.4f} "
        f"natural {step['on_policy_abs_logprob_diff_natural']:.4f}"
    )


def median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0
