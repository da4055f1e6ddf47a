"""Tests for deploy/grafana/fleetrl-dashboard.json and deploy/prometheus/prometheus.yml.

The dashboard may only query metrics this file lists. Rollout and coordinator metrics are checked against
what those roles export (rollout_service.metrics, coordinator.metrics); trainer metrics are the names the
trainer exports (TRAINER_METRICS, from trainer_service/metrics.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "fleetrl-dashboard.json"

ROLLOUT_METRICS = {
    "rollout_tokens_per_s",
    "rollout_requests_running",
    "rollout_requests_waiting",
    "rollout_requests_rejected_total",
    "rollout_kv_cache_usage_ratio",
    "rollout_policy_version",
    "rollout_time_to_first_token_s_bucket",
    "rollout_weight_update_s_bucket",
    "rollout_weight_update_pause_s_bucket",
}
COORDINATOR_METRICS = {
    "coordinator_groups_admitted_total",
    "coordinator_groups_pushed_total",
    "coordinator_redispatches_total",
    "coordinator_queue_depth",
    "coordinator_rollout_tokens_per_s",
    "coordinator_trainer_policy_version",
    "coordinator_eval_accuracy",
}
TRAINER_METRICS = {
    # trainer_service/metrics.py, set every step by trainer_service/__main__.py
    "trainer_samples_trained_total",
    "trainer_tokens_trained_total",
    "trainer_queue_depth",
    "trainer_staleness_max_steps",
    "trainer_staleness_steps_bucket",
    "trainer_staleness_steps_sum",
    "trainer_staleness_steps_count",
    "trainer_stale_dropped_total",
    "trainer_reward_mean",
    "trainer_loss",
    "trainer_geo_mask_masked_ratio",
    "trainer_icepop_masked_token_ratio",
    "trainer_mean_abs_logprob_diff",
    "trainer_publish_s_bucket",
    "trainer_policy_version",
}
BUILTIN = {"up"}  # written by Prometheus itself for every target
KNOWN_METRICS = ROLLOUT_METRICS | COORDINATOR_METRICS | TRAINER_METRICS | BUILTIN

PROMQL_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "offset",
    "bool",
    "and",
    "or",
    "unless",
    "inf",
    "nan",
}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords or labels."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals (label values)
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors, subqueries, $__rate_interval
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)  # label lists
    names = set()
    for match in re.finditer(r"(?<![\w.$])[A-Za-z_:][A-Za-z0-9_:]*", expr):
        if expr[match.end() :].lstrip().startswith("(") or match.group().lower() in PROMQL_KEYWORDS:
            continue  # a function or aggregation call, or an operator keyword
        names.add(match.group())
    return names


def all_panels(panels: list[dict]) -> list[dict]:
    return [p for panel in panels for p in (panel, *all_panels(panel.get("panels", [])))]


def test_promql_metric_names_skips_functions_labels_and_ranges():
    expr = (
        'histogram_quantile(0.95, sum by (le, instance) (rate(x_bucket{job="a b"}[$__rate_interval])))'
        ' / scalar(max(y)) - z offset 5m and on(instance) up{job="rollout"} * 1e3'
    )
    assert promql_metric_names(expr) == {"x_bucket", "y", "z", "up"}


def test_grafana_dashboard_queries_only_listed_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    panels = all_panels(dashboard["panels"])
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    used: set[str] = set()
    for panel in panels:
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            names = promql_metric_names(target["expr"])
            assert names, f"no metric in {target['expr']!r}"
            assert names <= KNOWN_METRICS, f"{panel['title']}: unlisted metrics {names - KNOWN_METRICS}"
            used |= names
    assert used == KNOWN_METRICS, f"listed but never queried: {KNOWN_METRICS - used}"


def test_listed_rollout_and_trainer_metrics_exist_in_their_registries():
    from prometheus_client import REGISTRY

    import rollout_service.metrics  # noqa: F401  (registers the rollout metrics)
    import trainer_service.metrics  # noqa: F401  (registers the trainer metrics)

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    exported = {family.name + suffix for family in REGISTRY.collect() for suffix in suffixes.get(family.type, ())}
    assert ROLLOUT_METRICS <= exported, f"renamed or removed: {ROLLOUT_METRICS - exported}"
    assert TRAINER_METRICS <= exported, f"renamed or removed: {TRAINER_METRICS - exported}"


def test_listed_coordinator_metrics_are_served_on_its_metrics_endpoint():
    import asyncio
    import urllib.request

    import redis.asyncio as aioredis
    from prometheus_client.parser import text_string_to_metric_families

    from channels.trajectory_stream import TrajectoryStreamWriter
    from coordinator.evaluation import EvalRunner
    from coordinator.fleet import Fleet
    from coordinator.metrics import MetricsReporter, start_metrics_server
    from coordinator.scheduler import Scheduler
    from coordinator.tasks import EchoTask
    from protos.config import RunConfig
    from protos.redis_keys import RedisKeys

    async def scrape() -> str:
        config, keys = RunConfig(), RedisKeys("metrics-test")
        queue = TrajectoryStreamWriter(aioredis.Redis.from_url("redis://127.0.0.1:1"), keys)  # never used by a scrape
        scheduler = Scheduler(config, Fleet([]), queue, EchoTask(), 10)
        evals = EvalRunner(config, scheduler.fleet, [], scorer=None)
        evals.latest = {"eval/aime-2025/acc": 0.25, "eval/aime-2025/pass@4": 0.5}
        runner, port = await start_metrics_server(
            MetricsReporter(scheduler, evals, queue, queue.client, keys), "127.0.0.1", 0
        )
        try:
            url = f"http://127.0.0.1:{port}/metrics"
            return await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read().decode())
        finally:
            await runner.cleanup()

    families = list(text_string_to_metric_families(asyncio.run(scrape())))
    exported = {sample.name for family in families for sample in family.samples}
    assert COORDINATOR_METRICS <= exported, f"renamed or removed: {COORDINATOR_METRICS - exported}"
    accuracy = [s for f in families for s in f.samples if s.name == "coordinator_eval_accuracy"]
    assert [(s.labels, s.value) for s in accuracy] == [({"dataset": "aime-2025"}, 0.25)]


def test_prometheus_config_scrapes_every_role_the_dashboard_uses():
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"rollout", "coordinator", "trainer"}
    for job in jobs.values():
        for static in job["static_configs"]:
            assert all(re.fullmatch(r"[\w.-]+:\d+", target) for target in static["targets"]), static
