"""The bounds around a weight load: the server's timeout, the worker's stacks while it is slow, the load profile."""

from __future__ import annotations

import asyncio
import threading

import pytest

from rollout_service import load_watchdog
from rollout_service.load_watchdog import WeightLoadTimeout, profiled_load, stacks_if_slow, within_load_timeout
from tests.waiting import wait_until

pytestmark = pytest.mark.unit


def test_a_load_past_its_timeout_raises_naming_the_version_and_the_setting_and_prints_the_stacks(capfd):
    never = asyncio.Event()

    async def stuck_load():
        await never.wait()

    with pytest.raises(WeightLoadTimeout, match=r"weights v7 .*weight_bus.load_timeout_s=0.05s"):
        asyncio.run(within_load_timeout(stuck_load(), 7, 0.05, "rollout-a"))
    assert "test_load_watchdog.py" in capfd.readouterr().err  # this process's stacks, down to the test


def test_a_load_within_its_timeout_or_without_one_returns_its_result():
    async def load():
        return 42

    assert asyncio.run(within_load_timeout(load(), 1, 5.0, "rollout-a")) == 42
    assert asyncio.run(within_load_timeout(load(), 1, None, "rollout-a")) == 42


def test_a_slow_block_prints_every_threads_stack_until_it_ends(tmp_path):
    release = threading.Event()
    log = tmp_path / "stacks.txt"
    with log.open("w") as out:
        waiter = threading.Thread(target=lambda: release.wait(30))  # a second thread: its stack is printed too
        waiter.start()
        with stacks_if_slow(0.05, file=out, min_interval_s=0.05):
            # the block stays open until the stacks are written: the slow load being watched
            wait_until(lambda: log.read_text().count("Thread") >= 2, "a dump of both threads' stacks", 10)
        release.set()
        waiter.join()
    dumped = log.read_text()
    assert "Thread" in dumped and "test_load_watchdog.py" in dumped


def test_a_load_profile_is_written_only_when_asked_for(tmp_path, monkeypatch):
    monkeypatch.delenv(load_watchdog.PROFILE_DIR_ENV, raising=False)
    with profiled_load(3, "plan"):
        sum(range(1000))
    assert not list(tmp_path.iterdir())
    monkeypatch.setenv(load_watchdog.PROFILE_DIR_ENV, str(tmp_path / "profiles"))

    def copy_buckets():
        return sorted(range(1000))

    with profiled_load(3, "reload"):
        copy_buckets()
    (written,) = (tmp_path / "profiles").iterdir()
    assert written.name.startswith("load-v3-reload-") and "copy_buckets" in written.read_text()


def test_a_pause_past_the_timeout_is_named_as_the_pause():
    from rollout_service.load_watchdog import PAUSE_STEP

    async def engine_that_never_pauses():
        await asyncio.Event().wait()

    with pytest.raises(WeightLoadTimeout, match=r"the pause of generation before weights v3 .*no longer answers"):
        asyncio.run(within_load_timeout(engine_that_never_pauses(), 3, 0.05, "rollout-a", PAUSE_STEP))
