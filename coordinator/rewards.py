"""Reward functions: the plug-in interface, group scoring, math and DAPO shaping.

A reward function is any callable ``fn(problem, response_text, response_len)``
returning a float, or an awaitable float. ``problem`` only needs a
``ground_truth`` attribute (see ``coordinator.datasets.Problem``).
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import math
import numbers
import threading
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

DEFAULT_REWARD_TIMEOUT_S = 30.0
# math_verify's own per-parse / per-compare limit; it uses signal.alarm, so it
# is only active when running in a main thread (e.g. in process-pool workers).
MATH_VERIFY_TIMEOUT_S = 5
# Caps on what is handed to math_verify: its parser is regex- and sympy-based
# and can take very long on long or adversarial input.
MAX_ANSWER_CHARS = 1000
FALLBACK_TAIL_CHARS = 300

_BOX_COMMANDS = ("\\boxed", "\\fbox")


@runtime_checkable
class RewardFn(Protocol):
    """Interface of reward functions (sync or async)."""

    def __call__(self, problem: Any, response_text: str, response_len: int) -> float | Awaitable[float]:
        """Scores one response.

        Args:
            problem: The prompt's problem; has at least ``ground_truth``.
            response_text: Decoded response.
            response_len: Response length in tokens.

        Returns:
            The reward, or an awaitable resolving to it.
        """


@dataclass(frozen=True)
class RewardResult:
    """Outcome of scoring one response.

    Attributes:
        reward: The reward; 0.0 when the reward function failed.
        error: Why the reward function failed, or None on success.
    """

    reward: float
    error: str | None = None


async def score_group(
    fn: RewardFn,
    problem: Any,
    responses: Sequence[tuple[str, int]],
    executor: Executor | None = None,
    timeout_s: float | None = DEFAULT_REWARD_TIMEOUT_S,
) -> list[RewardResult]:
    """Scores a group of responses to one problem concurrently.

    Coroutine functions are awaited on the event loop; plain functions run in
    ``executor`` (thread or process pool; None means the loop's default
    executor) so they never block the loop. With a process pool, ``fn`` and
    ``problem`` must be picklable. A failing, timing-out or non-finite call
    yields reward 0.0 with an error message instead of raising.

    Args:
        fn: The reward function.
        problem: Passed through to ``fn``.
        responses: ``(response_text, response_len)`` pairs.
        executor: Where sync reward functions run.
        timeout_s: Per-call limit in seconds, or None for no limit. A sync call
            that times out keeps occupying its worker until it returns; only
            the wait is abandoned.

    Returns:
        One result per response, in input order.
    """
    calls = (_score_one(fn, problem, text, n, executor, timeout_s) for text, n in responses)
    return list(await asyncio.gather(*calls))


async def _score_one(
    fn: RewardFn,
    problem: Any,
    text: str,
    length: int,
    executor: Executor | None,
    timeout_s: float | None,
) -> RewardResult:
    try:
        value = await asyncio.wait_for(_call(fn, problem, text, length, executor), timeout_s)
        return RewardResult(reward=_as_reward(value))
    except TimeoutError:
        return RewardResult(reward=0.0, error=f"reward function timed out after {timeout_s}s")
    except Exception as err:  # noqa: BLE001 - a plug-in bug must not stop training
        return RewardResult(reward=0.0, error=f"{type(err).__name__}: {err}")


async def _call(fn: RewardFn, problem: Any, text: str, length: int, executor: Executor | None) -> Any:
    if _is_async(fn):
        value = fn(problem, text, length)
    else:
        loop = asyncio.get_running_loop()
        value = await loop.run_in_executor(executor, fn, problem, text, length)
    # A sync callable may still hand back an awaitable (e.g. a wrapper).
    if inspect.isawaitable(value):
        value = await value
    return value


def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - the method itself, not callable()
    )


def _as_reward(value: Any) -> float:
    if not isinstance(value, numbers.Real):
        raise TypeError(f"reward must be a real number, got {type(value).__name__}")
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"reward must be finite, got {reward}")
    return reward


def last_boxed_content(text: str) -> str | None:
    """Returns the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``).

    Nested braces are matched; escaped braces (``\\{``, ``\\}``) are ignored
    for matching. ``\\boxed 5`` (no braces) yields ``"5"``.

    Args:
        text: Response text.

    Returns:
        The content, or None if there is no box or the last one is unclosed.
    """
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    rest = text[start + len(cmd) :]
    stripped = rest.lstrip()
    if not stripped.startswith("{"):
        if rest[:1] != " ":
            return None  # Another command such as \boxedanswer.
        token = stripped.split("$", 1)[0].split(None, 1)
        return token[0] if token else None
    return _braced(stripped)


def _braced(text: str) -> str | None:
    depth = 0
    i = 0
    while i < len(text):
        char = text[i]
        if char == "\\" and text[i + 1 : i + 2] in ("{", "}"):
            i += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[1:i]
        i += 1
    return None


def math_reward(ground_truth: str, response_text: str) -> float:
    """Checks a response's final answer against the reference with math_verify.

    The last ``\\boxed{...}`` is used when present. Without one, only the last
    ``FALLBACK_TAIL_CHARS`` characters are searched, and only for anchored
    answers ("the answer is ...", "Answer: ..."), so that a stray trailing
    number in an unfinished response is not rewarded.

    Args:
        ground_truth: Reference answer, e.g. "70" or "\\frac{1}{2}".
        response_text: Decoded response.

    Returns:
        1.0 if the answer is mathematically equivalent, else 0.0.

    Raises:
        ValueError: If the ground truth itself cannot be parsed.
    """
    from math_verify import parse, verify

    gold = _parse_gold(ground_truth)
    if not gold:
        raise ValueError(f"math_verify cannot parse ground truth {ground_truth!r}")
    timeout = _math_verify_timeout()
    boxed = last_boxed_content(response_text)
    if boxed is not None:
        if len(boxed) > MAX_ANSWER_CHARS:
            return 0.0
        pred = parse("\\boxed{" + boxed + "}", parsing_timeout=timeout)
    else:
        tail = response_text[-FALLBACK_TAIL_CHARS:]
        pred = parse(tail, extraction_config=_anchored_configs(), parsing_timeout=timeout)
    if not pred:
        return 0.0
    return 1.0 if verify(list(gold), pred, timeout_seconds=timeout) else 0.0


def _math_verify_timeout() -> int | None:
    # signal.alarm only works in the main thread; elsewhere the caller's
    # timeout (score_group) and the input length caps are the guard.
    if threading.current_thread() is threading.main_thread():
        return MATH_VERIFY_TIMEOUT_S
    return None


@functools.lru_cache(maxsize=8192)
def _parse_gold(ground_truth: str) -> tuple:
    # Cached: every response of a group shares the same ground truth, and
    # parsed sympy objects are immutable.
    from math_verify import parse

    text = ground_truth.strip()
    if len(text) > MAX_ANSWER_CHARS:
        return ()
    if "\\boxed" not in text:
        text = "\\boxed{" + text + "}"
    return tuple(parse(text, parsing_timeout=_math_verify_timeout()))


@functools.lru_cache(maxsize=1)
def _anchored_configs() -> tuple:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    return (
        LatexExtractionConfig(try_extract_without_anchor=False),
        ExprExtractionConfig(try_extract_without_anchor=False),
    )


def math_reward_fn(problem: Any, response_text: str, response_len: int) -> float:
    """The ``"math"`` reward: :func:`math_reward` as a :class:`RewardFn`."""
    del response_len  # Unused; part of the RewardFn interface.
    return math_reward(problem.ground_truth, response_text)


def overlong_penalty_reward(
    base_reward: float,
    response_len: int,
    max_response_len: int,
    buffer_len: int,
    factor: float,
) -> float:
    """Adds DAPO's soft overlong punishment to a reward.

    The penalty is 0 up to ``max_response_len - buffer_len`` tokens, falls
    linearly to ``-factor`` at ``max_response_len``, and stays at ``-factor``
    beyond.

    Args:
        base_reward: Reward before shaping.
        response_len: Response length in tokens.
        max_response_len: Generation length limit.
        buffer_len: Length of the linear ramp; 0 makes it a step.
        factor: Penalty magnitude at and beyond the limit.

    Returns:
        ``base_reward`` plus the (non-positive) penalty.

    Raises:
        ValueError: On negative sizes or factor, or a buffer above the limit.
    """
    if max_response_len <= 0 or not 0 <= buffer_len <= max_response_len or factor < 0:
        raise ValueError(
            f"invalid overlong settings: max_response_len={max_response_len}, buffer_len={buffer_len}, factor={factor}"
        )
    if response_len >= max_response_len:
        return base_reward - factor
    exceed = response_len - (max_response_len - buffer_len)
    if exceed <= 0:
        return base_reward
    return base_reward - factor * exceed / buffer_len


_BUILTIN_REWARDS: dict[str, RewardFn] = {"math": math_reward_fn}


def get_reward_fn(spec: str) -> RewardFn:
    """Resolves a reward function from a spec string.

    Args:
        spec: A built-in name (``"math"``) or ``"module.path:function"``; the
            part after the colon may be dotted (``"mod:Class.method"``). The
            plug-in may be sync or async.

    Returns:
        The reward function.

    Raises:
        ValueError: If the spec is malformed, the module cannot be imported,
            or the attribute is missing or not callable; names the spec.
    """
    spec = spec.strip()
    if spec in _BUILTIN_REWARDS:
        return _BUILTIN_REWARDS[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"unknown reward spec {spec!r}: expected one of {sorted(_BUILTIN_REWARDS)} or 'module.path:function'"
        )
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"reward spec {spec!r}: cannot import {module_name!r}: {err}") from err
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"reward spec {spec!r}: {module_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ValueError(f"reward spec {spec!r}: {attr!r} is not callable")
    return obj
