"""Memory of the fused LM-head log-probs, measured by its benchmark's CPU run (``benchmarks/fused_logprobs.py
--tiny``: 1,024 tokens x 8,192 vocabulary in tiles of 256 x 1,024, soft-cap and per-row temperatures).

The benchmark counts the bytes of live tensors created during forward and backward (gradients included) of each
path; the goal of issue 17 is a fused peak of at most a quarter of the unfused one, with the values equal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_fused_logprobs_use_at_most_a_quarter_of_the_unfused_peak_memory_with_equal_values():
    run = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "fused_logprobs.py"), "--tiny", "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        cwd=REPO_ROOT,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])

    assert result["unfused"]["peak_gib"] > 0.1  # the unfused path holds several [1024, 8192] fp32 tensors
    assert result["peak_ratio"] <= 0.25 and result["goal_peak_ratio_le_0.25"], result
    assert max(result["max_relative_diff_fp32"].values()) <= 1e-5, result
