"""Tests for coordinator.rewards."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import pytest

from coordinator.datasets import Problem, load_dataset
from coordinator.rewards import (
    RewardFn,
    RewardResult,
    get_reward_fn,
    last_boxed_content,
    math_reward,
    math_reward_fn,
    overlong_penalty_reward,
    score_group,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("filename", ["aime-2024.jsonl", "aime-2025.jsonl"])
def test_math_reward_on_every_aime_answer(shared_data: Path, filename: str) -> None:
    rows = [json.loads(line) for line in (shared_data / filename).read_text().splitlines()]
    assert len(rows) == 30
    for row in rows:
        answer = row["answer"]
        right = f"Long derivation... so the answer is \\boxed{{{answer}}}"
        wrong = f"Long derivation... so the answer is \\boxed{{{int(answer) + 1}}}"
        assert math_reward(answer, right) == 1.0, row["id"]
        assert math_reward(answer, wrong) == 0.0, row["id"]


def test_math_reward_on_zero_padded_parquet_truths(shared_data: Path) -> None:
    problems = load_dataset(shared_data / "aime-2024.parquet")
    padded = [p for p in problems if p.ground_truth.startswith("0")]
    assert padded  # e.g. "025"
    for p in padded:
        assert math_reward(p.ground_truth, f"\\boxed{{{int(p.ground_truth)}}}") == 1.0


@pytest.mark.parametrize(
    ("truth", "response", "expected"),
    [
        ("70", "\\boxed{070}", 1.0),
        ("070", "thus $\\boxed{70}$.", 1.0),
        ("0.5", "\\boxed{\\frac{1}{2}}", 1.0),
        ("\\frac{1}{2}", "\\boxed{0.5}", 1.0),
        ("\\frac{\\sqrt{3}}{2}", "\\boxed{\\dfrac{\\sqrt 3}{2}}", 1.0),
        ("2", "first \\boxed{1}, finally \\boxed{2}", 1.0),
        ("1", "first \\boxed{1}, finally \\boxed{2}", 0.0),
        ("204", "so the final answer is 204", 1.0),
        ("204", "Answer: 204", 1.0),
        ("204", "we computed 204", 0.0),
        ("204", "no answer here", 0.0),
        ("3", "\\boxed{3", 0.0),
    ],
)
def test_math_reward_forms(truth: str, response: str, expected: float) -> None:
    assert math_reward(truth, response) == expected


def test_math_reward_caps_long_answers() -> None:
    start = time.monotonic()
    assert math_reward("1", "\\boxed{" + "(" * 5000 + "1}") == 0.0
    assert math_reward("1", "x" * 200_000 + "\\boxed{1}") == 1.0
    assert time.monotonic() - start < 5


def test_math_reward_rejects_unparsable_truth() -> None:
    with pytest.raises(ValueError, match="ground truth"):
        math_reward("", "\\boxed{1}")


def test_last_boxed_content() -> None:
    assert last_boxed_content("a \\boxed{\\frac{1}{\\sqrt{2}}} b") == "\\frac{1}{\\sqrt{2}}"
    assert last_boxed_content("\\boxed{\\{1, 2\\}}") == "\\{1, 2\\}"
    assert last_boxed_content("\\boxed 5$.") == "5"
    assert last_boxed_content("\\fbox{3} then \\boxed{4}") == "4"
    assert last_boxed_content("\\boxed{open") is None
    assert last_boxed_content("nothing") is None


@pytest.mark.parametrize(
    ("length", "expected"),
    [(0, 1.0), (80, 1.0), (90, 0.5), (95, 0.25), (100, 0.0), (500, 0.0)],
)
def test_overlong_penalty(length: int, expected: float) -> None:
    got = overlong_penalty_reward(1.0, length, max_response_len=100, buffer_len=20, factor=1.0)
    assert got == pytest.approx(expected)


def test_overlong_penalty_edge_settings() -> None:
    assert overlong_penalty_reward(0.0, 99, 100, 0, 0.5) == 0.0
    assert overlong_penalty_reward(0.0, 100, 100, 0, 0.5) == -0.5
    with pytest.raises(ValueError):
        overlong_penalty_reward(0.0, 1, 100, 200, 1.0)


PLUGIN = """
import asyncio
import math
import threading

THREADS = []


def sync_len(problem, response_text, response_len):
    THREADS.append(threading.get_ident())
    return float(response_len)


async def async_match(problem, response_text, response_len):
    await asyncio.sleep(0)  # a yield, not a wait: it suspends once, as a plug-in that does I/O would
    return 1.0 if response_text == problem.ground_truth else 0.0


def boom(problem, response_text, response_len):
    raise RuntimeError("boom " + response_text)


async def slow(problem, response_text, response_len):
    await asyncio.Event().wait()  # never answers: the scorer's timeout must end it
    return 1.0


def not_finite(problem, response_text, response_len):
    return math.nan


def not_a_number(problem, response_text, response_len):
    return "1.0"


class Scorer:
    @staticmethod
    def score(problem, response_text, response_len):
        return 0.25
"""


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    name = f"fleetrl_test_plugin_{abs(hash(tmp_path))}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


PROBLEM = Problem("p0", [{"role": "user", "content": "q"}], "42", "test")


def test_registry_resolves_builtin_and_plugins(plugin: str) -> None:
    assert get_reward_fn("math") is math_reward_fn
    assert isinstance(math_reward_fn, RewardFn)
    assert get_reward_fn(f"{plugin}:Scorer.score")(PROBLEM, "", 0) == 0.25
    assert asyncio.run(get_reward_fn(f"{plugin}:async_match")(PROBLEM, "42", 1)) == 1.0
    for spec in ["nope", "no_such_module_xyz:f", f"{plugin}:missing", f"{plugin}:THREADS", ":f"]:
        with pytest.raises(ValueError, match=spec.replace(".", r"\.")):
            get_reward_fn(spec)


def test_score_group_sync_plugin_runs_in_executor(plugin: str) -> None:
    fn = get_reward_fn(f"{plugin}:sync_len")

    async def main() -> tuple[list[RewardResult], int]:
        with ThreadPoolExecutor(2) as pool:
            return await score_group(fn, PROBLEM, [("a", 3), ("b", 5)], pool), threading.get_ident()

    results, loop_thread = asyncio.run(main())
    assert results == [RewardResult(3.0), RewardResult(5.0)]
    threads = sys.modules[plugin].THREADS
    assert len(threads) == 2 and loop_thread not in threads


def test_score_group_async_plugin(plugin: str) -> None:
    fn = get_reward_fn(f"{plugin}:async_match")
    results = asyncio.run(score_group(fn, PROBLEM, [("42", 2), ("41", 2), ("42", 9)], None))
    assert [r.reward for r in results] == [1.0, 0.0, 1.0]
    assert all(r.error is None for r in results)


def test_score_group_errors_become_zero_reward(plugin: str) -> None:
    async def main() -> list[list[RewardResult]]:
        groups = []
        for name in ["boom", "not_finite", "not_a_number", "slow"]:
            fn = get_reward_fn(f"{plugin}:{name}")
            groups.append(await score_group(fn, PROBLEM, [("x", 1)], None, timeout_s=0.2))
        return groups

    boom, nan, text, slow = (group[0] for group in asyncio.run(main()))
    assert boom == RewardResult(0.0, "RuntimeError: boom x")
    assert nan.reward == 0.0 and "finite" in nan.error
    assert text.reward == 0.0 and "real number" in text.error
    assert slow.reward == 0.0 and "timed out" in slow.error


def test_score_group_math_in_process_pool() -> None:
    responses = [("so \\boxed{42}", 4), ("so \\boxed{41}", 4), ("\\boxed{42.0}", 4)]

    async def main() -> list[RewardResult]:
        with ProcessPoolExecutor(1) as pool:
            return await score_group(get_reward_fn("math"), PROBLEM, responses, pool)

    assert asyncio.run(main()) == [RewardResult(1.0), RewardResult(0.0), RewardResult(1.0)]


def test_score_group_math_in_thread_pool() -> None:
    bad_truth = Problem("p1", [], "", "test")

    async def main() -> list[RewardResult]:
        with ThreadPoolExecutor(1) as pool:
            good = await score_group(math_reward_fn, PROBLEM, [("\\boxed{42}", 3)], pool)
            bad = await score_group(math_reward_fn, bad_truth, [("\\boxed{42}", 3)], pool)
            return good + bad

    good, bad = asyncio.run(main())
    assert good == RewardResult(1.0)
    assert bad.reward == 0.0 and "ground truth" in bad.error
