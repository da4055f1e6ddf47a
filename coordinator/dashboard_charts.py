"""What the dashboard draws: its charts (in page order, the reward first), the report keys they read, and each
chart's lines for a time window, from the run's ``SeriesHistory`` per source (coordinator/dashboard_history.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from coordinator.dashboard_history import SeriesHistory

EVAL_KEY = re.compile(r"^eval/(?P<dataset>.+)/acc$")
# Cumulative count of groups trained at staleness k, if the trainer reports it ("staleness_groups/0": 12.0).
STALENESS_COUNT_KEY = re.compile(r"^staleness_groups/(?P<steps>\d+)$")


@dataclass(frozen=True)
class SeriesRef:
    """One line of a chart: ``values[key]`` of the reports of ``role``; for a role with several sources (the rollout
    servers) one line per source, labelled with the source."""

    role: str
    key: str
    label: str


@dataclass(frozen=True)
class ChartSpec:
    """A chart of the page; a line whose series no role reports is drawn as "no data"."""

    chart_id: str
    title: str
    unit: str
    lines: tuple[SeriesRef, ...]


CHARTS = (
    ChartSpec("reward", "Reward", "", (SeriesRef("trainer", "reward_mean", "trained batch mean"),)),
    ChartSpec(
        "rollout_tokens",
        "Rollout tokens/s (each server over its last 10 s)",
        "tok/s",
        (SeriesRef("coordinator", "tokens_per_s", "fleet"), SeriesRef("rollout", "tokens_per_s", "")),
    ),
    ChartSpec(
        "trainer_samples", "Trainer samples/s", "samples/s", (SeriesRef("trainer", "samples_per_s", "samples/s"),)
    ),
    ChartSpec("trainer_tokens", "Trainer tokens/s", "tok/s", (SeriesRef("trainer", "tokens_per_s", "loss tokens/s"),)),
    ChartSpec(
        "queue_depth",
        "Queue depth",
        "groups",
        (
            SeriesRef("trainer", "queue_depth", "at trainer step"),
            SeriesRef("coordinator", "queue_depth", "coordinator"),
        ),
    ),
    ChartSpec(
        "staleness",
        "Staleness",
        "steps",
        (SeriesRef("trainer", "staleness_max", "max"), SeriesRef("trainer", "staleness_mean", "mean")),
    ),
    ChartSpec("eval_acc", "Eval accuracy", "", ()),  # lines found at run time: eval/<dataset>/acc
    ChartSpec(
        "rollout_running", "Rollout requests running", "requests", (SeriesRef("rollout", "requests_running", ""),)
    ),
    ChartSpec("rollout_kv_cache", "Rollout KV-cache use", "", (SeriesRef("rollout", "kv_cache_usage", ""),)),
    ChartSpec(
        "weight_update",
        "Weight update duration",
        "s",
        (SeriesRef("trainer", "publish_s", "trainer publish"), SeriesRef("rollout", "weight_update_s", "")),
    ),
    ChartSpec(
        "masked",
        "Masked-sequence ratio",
        "",
        (
            SeriesRef("trainer", "geo_mask_masked_ratio", "geo-mask sequences"),
            SeriesRef("trainer", "icepop_masked_token_ratio", "icepop tokens"),
        ),
    ),
    ChartSpec(
        "abs_dlogp",
        "Mean |\u0394logp| trainer vs rollout",
        "nats",
        (SeriesRef("trainer", "mean_abs_logprob_diff", "mean |\u0394logp|"),),
    ),
    ChartSpec("loss", "Loss", "", (SeriesRef("trainer", "loss", "loss"),)),
)


def charted_keys(role: str):
    """Which report keys of ``role`` the charts read: the history keeps a column for these only."""
    keys = {ref.key for spec in CHARTS for ref in spec.lines if ref.role == role}
    return lambda key: key in keys or EVAL_KEY.match(key) is not None


Histories = dict[tuple[str, str], SeriesHistory]  # (role, source) -> history; source "" for a role's only instance


def render_chart(spec: ChartSpec, histories: Histories, from_s: float, to_s: float, max_points: int) -> dict:
    """The chart's lines over [from_s, to_s]: ``series`` names a line (``role/key``, or ``role/source/key``),
    ``points`` are ``[time_s, value]`` (at most ``max_points``), ``latest`` is the newest report's value."""
    lines = []
    refs = eval_refs(histories) if spec.chart_id == "eval_acc" else spec.lines
    for ref in refs:
        sources = sorted(source for role, source in histories if role == ref.role)
        for source in sources or [""]:
            history = histories.get((ref.role, source))
            points = history.window(ref.key, from_s, to_s, max_points) if history else []
            latest = history.latest.get(ref.key) if history else None
            series = f"{ref.role}/{source}/{ref.key}" if source else f"{ref.role}/{ref.key}"
            label = ref.label or source or ref.role
            lines.append({"series": series, "label": label, "points": points, "latest": latest})
    return {"id": spec.chart_id, "title": spec.title, "unit": spec.unit, "lines": lines}


def eval_refs(histories: Histories) -> list[SeriesRef]:
    found = {
        (role, key): SeriesRef(role, key, match["dataset"])
        for (role, _source), history in histories.items()
        for key in history.columns
        if (match := EVAL_KEY.match(key))
    }
    return sorted(found.values(), key=lambda ref: (ref.label, ref.role))


def staleness_histogram(trainer: SeriesHistory | None) -> dict:
    """Groups trained at each staleness over the whole run (the trainer's cumulative counts), or, from a trainer that
    does not report them, the latest step's maximum."""
    if trainer is None or not trainer.num_reports:
        return {"source": "", "bins": []}
    counts = {int(m["steps"]): v for k, v in trainer.latest.items() if (m := STALENESS_COUNT_KEY.match(k))}
    if counts:
        return {"source": "groups trained at each staleness (whole run)", "bins": sorted(counts.items())}
    steps = trainer.latest.get("staleness_max")
    bins = [] if steps is None else [(int(steps), 1)]
    return {"source": "the last step's max staleness (the trainer reports no counts)", "bins": bins}
