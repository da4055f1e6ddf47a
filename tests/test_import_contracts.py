"""The layering contracts of pyproject.toml [tool.importlinter] hold (protos/modeling import no role, channels
imports only protos, weight_bus only protos and channels, the three roles never import each other, the launcher
imports only protos, channels and modeling and no role imports it, the coordinator's core imports nothing of its
agent gateway but where it is wired in)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    lint_imports = Path(sys.executable).with_name("lint-imports")
    command = [str(lint_imports)] if lint_imports.exists() else ["lint-imports"]
    result = subprocess.run(
        [*command, "--no-cache", "--no-logo"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"lint-imports failed:\n{result.stdout}\n{result.stderr}"
    assert " 0 broken" in result.stdout, result.stdout


def test_the_launcher_is_kept_apart_from_the_roles():
    """The launcher starts the roles as processes: it imports none of them, and none of them imports it."""
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    forbidden = {
        (tuple(contract["source_modules"]), tuple(contract["forbidden_modules"]))
        for contract in config["contracts"]
        if contract["type"] == "forbidden"
    }
    roles = ("rollout_service", "trainer_service", "coordinator")
    assert "launcher" in config["root_packages"]
    assert any(source == ("launcher",) and set(roles) <= set(banned) for source, banned in forbidden)
    assert any(set(source) == set(roles) and banned == ("launcher",) for source, banned in forbidden)


def test_the_coordinators_core_is_kept_apart_from_its_agent_gateway():
    """Every coordinator module but the gateway's wiring (__main__, kept_port) is barred from coordinator.agents,
    and only the gateway's own imports, the wiring's and nothing else are let through."""
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    [contract] = [c for c in config["contracts"] if "coordinator.agents" in c.get("forbidden_modules", [])]
    assert contract["type"] == "forbidden" and contract["source_modules"] == ["coordinator.*"]
    assert set(contract["ignore_imports"]) == {
        "coordinator.agents.** -> coordinator.agents.**",
        "coordinator.__main__ -> coordinator.agents.**",
        "coordinator.__main__ -> coordinator.kept_port",
        "coordinator.kept_port -> coordinator.agents.**",
    }
