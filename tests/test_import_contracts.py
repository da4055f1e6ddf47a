"""The layering contracts of pyproject.toml [tool.importlinter] hold (protos/modeling import no role, channels
imports only protos, weight_bus only protos and channels, the three roles never import each other)."""

from __future__ import annotations

import subprocess
import sys
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
