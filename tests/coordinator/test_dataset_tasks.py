"""Dataset tasks on the tiny model's tokenizer (chat templates, length limits, reward plugins, the overlong penalty)
and the demo-math recipe's task and eval sets."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from coordinator.rewards import get_reward_fn
from coordinator.tasks import DatasetTask, PromptRenderer, ResponseScorer, build_task
from protos.config import load_run_config
from tests.coordinator.task_files import write_plain

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_dataset_prompts_use_the_chat_template_with_its_kwargs(tiny_tokenizer, tmp_path):
    path = write_plain(tmp_path / "arith.jsonl", [("what is 1+1", "2")])
    config = load_run_config(
        overrides=[
            f"coordinator.task={path}",
            "coordinator.prompt_template='{problem}?'",
            "coordinator.chat_template_kwargs={reasoning_effort: high}",
        ]
    ).coordinator
    task = build_task(config, 256, tiny_tokenizer, None)
    prompt = task.next_prompt()
    assert tiny_tokenizer.decode(prompt.prompt_token_ids) == "<bos>what is 1+1?h"  # the tiny template's effort mark
    assert prompt.data_source == "arith" and prompt.payload.ground_truth == "2"


def test_a_tokenizer_without_chat_template_gets_the_plain_fallback(tiny_tokenizer):
    tiny_tokenizer.chat_template = None
    renderer = PromptRenderer(tiny_tokenizer, {"reasoning_effort": "high"})
    ids = renderer.render([{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1"}])
    assert ids == [tiny_tokenizer.bos_token_id, *tiny_tokenizer.encode("be brief\n\n1+1", add_special_tokens=False)]


def test_prompts_longer_than_the_model_allows_are_skipped_and_counted(tiny_tokenizer, tmp_path):
    path = write_plain(tmp_path / "mixed.jsonl", [("x" * 300, "1"), ("short", "2")])
    overrides = [f"coordinator.task={path}", "coordinator.prompt_template='{problem}'"]
    run = load_run_config(overrides=overrides)
    config = run.coordinator
    task = build_task(config, 256, tiny_tokenizer, None)
    assert {task.next_prompt().payload.ground_truth for _ in range(4)} == {"2"}
    assert 3 <= task.prompts_too_long <= 5  # one per epoch, give or take the shuffles
    config.sampling.max_tokens = 255  # now nothing fits
    with pytest.raises(ValueError, match="no prompt of mixed fits in 1 tokens"):
        task.next_prompt()


def test_dataset_rewards_come_from_the_plugin_plus_the_overlong_penalty(tiny_tokenizer, tmp_path):
    path = write_plain(tmp_path / "p.jsonl", [("q", "1")])
    config = load_run_config(
        overrides=[
            f"coordinator.task={path}",
            "coordinator.reward_fn=tests.coordinator.reward_plugins:always_one",
            "coordinator.sampling.max_tokens=8",
            "coordinator.overlong={enabled: true, buffer_len: 4, penalty_factor: 1.0}",
        ]
    ).coordinator
    task = build_task(config, 256, tiny_tokenizer, None)
    assert isinstance(task, DatasetTask)
    results = asyncio.run(task.score(task.next_prompt(), [[5] * 2, [5] * 6, [5] * 8]))
    assert [r.reward for r in results] == [1.0, 0.5, 0.0]


def test_async_reward_plugins_are_awaited(tiny_tokenizer):
    scorer = ResponseScorer(tiny_tokenizer, get_reward_fn("tests.coordinator.reward_plugins:parity_of_text"), None, 5)
    results = asyncio.run(scorer.score(object(), [[5], [6], [7], [8]]))
    assert {r.reward for r in results} <= {0.0, 1.0} and all(r.error is None for r in results)


def test_demo_math_recipe_builds_its_task_and_eval_sets(tiny_tokenizer, monkeypatch, shared_data):
    from coordinator.evaluation import load_eval_sets

    monkeypatch.chdir(REPO_ROOT)  # the recipe's paths are relative to the repository root
    config = load_run_config(REPO_ROOT / "recipes" / "demo-math.yaml")
    task = build_task(config.coordinator, config.rollout.max_model_len, tiny_tokenizer, None)
    prompts = [task.next_prompt() for _ in range(16)]
    assert all(len(p.prompt_token_ids) <= 256 - 32 for p in prompts)
    sets = load_eval_sets(config.coordinator, PromptRenderer(tiny_tokenizer, {}), config.rollout.max_model_len)
    assert [s.name for s in sets] == ["aime-2025"] and sets[0].problems
