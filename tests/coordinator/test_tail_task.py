"""The long-tail task: heavy-tailed response lengths, a seeded replayable stream, its reward, and requests capped at
the length each prompt asks for."""

from __future__ import annotations

import asyncio
import random
import statistics
from types import SimpleNamespace

import pytest

from coordinator.fleet import Fleet
from coordinator.rollout_client import SampleResult
from coordinator.scheduler import Scheduler
from coordinator.tail_task import TailTask, draw_length
from coordinator.tasks import build_task
from modeling.tiny_model import BOS_ID, DIGIT_IDS, EOS_ID, vocab
from protos.config import load_run_config

pytestmark = pytest.mark.unit


def test_lengths_are_long_tailed_within_their_bounds():
    rng = random.Random(0)
    lengths = sorted(draw_length(rng, 1, 96) for _ in range(20_000))
    p50, p99 = lengths[len(lengths) // 2], lengths[int(0.99 * len(lengths))]
    assert lengths[0] == 1 and lengths[-1] == 96
    assert p99 / p50 >= 8, (p50, p99)


def test_the_prompt_states_the_length_and_the_digit_and_caps_the_request_there():
    prompt = TailTask(seed=3).next_prompt()
    length, digit = prompt.payload
    written = "".join(str(DIGIT_IDS.index(t)) for t in prompt.prompt_token_ids[1:-2])
    assert prompt.prompt_token_ids[0] == BOS_ID and int(written) == length
    assert prompt.prompt_token_ids[-2] == vocab()[":"] and prompt.prompt_token_ids[-1] == digit
    assert prompt.max_tokens == length + 1  # the digits and the stop


def test_the_stream_is_seeded_and_replays_from_a_cursor_and_by_id():
    task, again = TailTask(seed=7), TailTask(seed=7)
    first = [task.next_prompt() for _ in range(30)]
    assert [p.prompt_token_ids for p in first] == [again.next_prompt().prompt_token_ids for _ in range(30)]
    resumed = TailTask(seed=7)
    resumed.restore(TailTask(seed=7).cursor() | {"draws": 10})
    assert resumed.next_prompt() == first[10]
    assert task.prompt_by_id("tail-12") == first[11]
    with pytest.raises(ValueError, match="no tail prompt id"):
        task.prompt_by_id("echo-3")
    with pytest.raises(ValueError, match="seed 8"):
        resumed.restore({"seed": 8, "draws": 1})


def test_the_reward_counts_correct_positions_and_the_stop():
    task = TailTask(seed=1)
    prompt = next(p for p in (task.next_prompt() for _ in range(100)) if p.payload[0] >= 4)
    length, digit = prompt.payload
    other = next(d for d in DIGIT_IDS if d != digit)
    assert task.reward(prompt, [digit] * length + [EOS_ID]) == pytest.approx(1.0)
    assert task.reward(prompt, [digit] * (length + 1)) == pytest.approx(0.9)  # right digits, no stop
    assert task.reward(prompt, [digit] * (length // 2) + [EOS_ID]) == pytest.approx(0.9 * (length // 2) / length)
    assert task.reward(prompt, [other] * length + [EOS_ID]) == pytest.approx(0.1)
    assert task.reward(prompt, []) == 0.0


def test_the_config_builds_it_and_refuses_a_minimum_above_the_maximum():
    config = load_run_config(overrides=["coordinator.task=tail", "coordinator.sampling.max_tokens=40"])
    task = build_task(config.coordinator, config.rollout.max_model_len, None, None)
    assert isinstance(task, TailTask) and task.max_tokens == 40 and task.min_tokens == 1
    bad = load_run_config(overrides=["coordinator.task=tail", "coordinator.tail_min_tokens=41"])
    with pytest.raises(ValueError, match="coordinator.tail_min_tokens 41"):
        build_task(bad.coordinator, bad.rollout.max_model_len, None, None)


class RecordingFleet(Fleet):
    """A fleet without servers whose generate answers at once with ``max_tokens`` digit tokens per sample and records
    the sampling of each request (the scheduler's request building is what is under test, not the servers)."""

    def __init__(self):
        super().__init__([])
        self.requested: list[int] = []

    async def generate(self, prompt_token_ids, n, sampling, **kwargs):
        self.requested.append(sampling.max_tokens)
        tokens = [DIGIT_IDS[0]] * sampling.max_tokens
        results = [SampleResult(token_ids=tokens, logprobs=[0.0] * len(tokens)) for _ in range(n)]
        return results, SimpleNamespace(server_id="rollout-0", address="127.0.0.1:1")


def test_the_scheduler_asks_each_request_for_the_prompts_own_length():
    config = load_run_config(overrides=["coordinator.task=tail", "coordinator.sampling.max_tokens=64"])
    fleet, task = RecordingFleet(), TailTask(seed=0, max_tokens=64)
    scheduler = Scheduler(config, fleet, None, task, 8, 0)
    prompts = [task.next_prompt() for _ in range(8)]
    replay = TailTask(seed=0, max_tokens=64)
    for prompt in prompts:
        assert replay.next_prompt() == prompt
    for slot, prompt in enumerate(prompts):
        asyncio.run(scheduler._generate_group(slot, prompt, 0, 0.0))
    assert fleet.requested == [p.payload[0] + 1 for p in prompts]
    assert statistics.pstdev(fleet.requested) > 0  # lengths differ from prompt to prompt
