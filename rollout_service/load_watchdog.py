"""A weight load that never ends must not hold generation forever, and must say where it is stuck.

A load runs inside the engine's pause (``RolloutEngine.commit_weights``), in vLLM's worker processes, through
``collective_rpc``. A worker stuck there (a kernel that never returns, a lock, a loader loop) would keep the server
paused and every caller waiting. So:

- in the server, ``within_load_timeout`` bounds the load by ``weight_bus.load_timeout_s``; past it the server's own
  stacks go to its log and ``WeightLoadTimeout`` is raised: the engine is then in an unknown state (half the layers
  may be new), so the server stops and its supervisor restarts it on the latest version;
- in the worker, ``stacks_if_slow`` makes the worker print every thread's stack to the same log while a load runs
  past half that timeout (and again each half-timeout), so the log says where it hangs before the server gives up.

``FLEETRL_PROFILE_WEIGHT_LOADS=<dir>`` (an operator's switch, read in the worker) writes one cProfile summary per
load there: the functions a load spends its time in (vLLM's reload, quantization, copies).
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import os
import sys
import time
from collections.abc import Awaitable, Iterator
from typing import TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")
PROFILE_DIR_ENV = "FLEETRL_PROFILE_WEIGHT_LOADS"


class WeightLoadTimeout(RuntimeError):
    """A version's load into the engine did not finish in time; the engine may hold half of it."""


LOAD_STEP = ("the load of weights v{version} into the engine", "the engine may hold part of the new weights")
# An engine whose kernels never return (Marlin spinning on a freed workspace: rollout_service/kernel_scratch.py) never
# pauses either: the step before the load is bounded by the same setting.
PAUSE_STEP = ("the pause of generation before weights v{version}", "the engine no longer answers")


async def within_load_timeout(
    load: Awaitable[T], version: int, timeout_s: float | None, server_id: str, step: tuple[str, str] = LOAD_STEP
) -> T:
    """Await ``load`` (a step of a weight update, ``LOAD_STEP`` or ``PAUSE_STEP``) for at most ``timeout_s`` (None: no
    bound); on expiry dump this process's stacks to stderr and raise WeightLoadTimeout naming the step, the version
    and the setting."""
    if timeout_s is None:
        return await load
    try:
        return await asyncio.wait_for(load, timeout=timeout_s)
    except TimeoutError:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        what, state = step
        raise WeightLoadTimeout(
            f"rollout server {server_id}: {what.format(version=version)} did not finish within "
            f"weight_bus.load_timeout_s={timeout_s:g}s (the stacks are in this log); {state}, so the server stops "
            "and is restarted on the latest version"
        ) from None


MIN_STACKS_INTERVAL_S = 5.0  # a stuck load's stacks every few seconds are enough; more would flood the log


@contextlib.contextmanager
def stacks_if_slow(seconds: float, file=None, min_interval_s: float = MIN_STACKS_INTERVAL_S) -> Iterator[None]:
    """Print every thread's stack to ``file`` (stderr) each ``seconds`` (at least ``min_interval_s``) while the
    block runs; 0: off. One timer per process: faulthandler keeps a single one, and loads do not overlap (the
    engine's update lock)."""
    if seconds <= 0:
        yield
        return
    faulthandler.dump_traceback_later(max(seconds, min_interval_s), repeat=True, file=file or sys.stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@contextlib.contextmanager
def profiled_load(version: int, path: str) -> Iterator[None]:
    """With FLEETRL_PROFILE_WEIGHT_LOADS set, profile the block and write its 40 costliest functions (cumulative)
    to ``<dir>/load-v<version>-<path>-<pid>.txt``; otherwise nothing."""
    directory = os.environ.get(PROFILE_DIR_ENV, "")
    if not directory:
        yield
        return
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    started = time.perf_counter()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        text = io.StringIO()
        text.write(f"weights v{version} via {path}: {time.perf_counter() - started:.3f}s\n")
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(40)
        os.makedirs(directory, exist_ok=True)
        target = os.path.join(directory, f"load-v{version}-{path}-{os.getpid()}.txt")
        with open(target, "w") as out:
            out.write(text.getvalue())
        logger.info("weight load profile written to %s", target)
