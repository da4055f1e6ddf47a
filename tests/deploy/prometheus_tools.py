"""Finding Debian's prometheus and promtool for the observability tests (``scripts/install_prometheus.sh``)."""

from __future__ import annotations

import os
import shutil

import pytest


def find_tool(name: str) -> str:
    """The path of ``prometheus`` or ``promtool``; a missing one fails the test (``make test`` installs both)."""
    override = os.environ.get(f"FLEETRL_{name.upper()}", "")
    for candidate in (override, f"/usr/bin/{name}", shutil.which(name) or ""):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    pytest.fail(f"{name} not installed: run scripts/install_prometheus.sh (or set FLEETRL_{name.upper()})")
