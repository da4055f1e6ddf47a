"""Dataset files for the coordinator's task tests."""

from __future__ import annotations

import json
from pathlib import Path


def write_plain(path: Path, problems: list[tuple[str, str]]) -> Path:
    """A JSONL dataset of ``{"problem", "answer"}`` rows at ``path``."""
    path.write_text("".join(json.dumps({"problem": p, "answer": a}) + "\n" for p, a in problems))
    return path
