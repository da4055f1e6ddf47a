"""deploy/prometheus/alerts.yml checked and unit-tested by Debian's promtool, and the scrape config that loads it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.prometheus_tools import find_tool

pytestmark = pytest.mark.integration

PROMETHEUS_DIR = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
ALERTS = {
    "FleetrlStalenessOverBound",
    "FleetrlQueueGrowing",
    "FleetrlRolloutServerDown",
    "FleetrlWeightUpdateFailing",
    "FleetrlWeightUpdateSlow",
    "FleetrlTrainerNotStepping",
    "FleetrlTrainerDown",
}


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [find_tool("promtool"), *args], cwd=PROMETHEUS_DIR, capture_output=True, text=True, timeout=120
    )


def test_alert_rules_pass_promtool_check():
    result = promtool("check", "rules", "alerts.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in result.stdout


def test_every_alert_has_a_firing_and_a_quiet_case_in_the_rule_tests():
    rules = yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())
    assert {rule["alert"] for group in rules["groups"] for rule in group["rules"]} == ALERTS
    cases = yaml.safe_load((PROMETHEUS_DIR / "alerts.test.yml").read_text())["tests"]
    checks = [check for case in cases for check in case["alert_rule_test"]]
    assert {c["alertname"] for c in checks if c["exp_alerts"]} == ALERTS, "an alert is never shown firing"
    assert {c["alertname"] for c in checks if not c["exp_alerts"]} == ALERTS, "an alert is never shown quiet"


def test_alert_rules_fire_as_their_unit_tests_expect():
    result = promtool("test", "rules", "alerts.test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_the_scrape_config_loads_the_alert_rules():
    # prometheus-kubernetes.yml is not checked here: Debian's build has no kubernetes_sd_configs.
    result = promtool("check", "config", "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in result.stdout
    assert yaml.safe_load((PROMETHEUS_DIR / "prometheus-kubernetes.yml").read_text())["rule_files"] == ["alerts.yml"]
