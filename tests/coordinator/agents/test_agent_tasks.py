"""Prompts of the coordinator's task by id (an agent's ``task_id``) and the run's reward of an agent session:
the echo task and a dataset file on the tiny model's tokenizer."""

from __future__ import annotations

import asyncio
import json

import pytest

from coordinator.agents.errors import InvalidArgument
from coordinator.agents.groups import AgentGroup, Session, Turn
from coordinator.agents.tasks import AgentTasks
from coordinator.scheduler import SchedulerStats
from coordinator.tasks import MAX_ECHO_PROMPT, EchoTask, build_task
from modeling.tiny_model import build_tokenizer
from protos.config import load_run_config

pytestmark = pytest.mark.unit


def test_an_echo_task_id_names_the_prompt_the_coordinator_draws_at_that_place():
    drawn = EchoTask(seed=3)
    prompts = [drawn.next_prompt() for _ in range(5)]
    by_id = EchoTask(seed=3)
    assert [by_id.prompt_by_id(f"echo-{n}") for n in (5, 1, 3)] == [prompts[4], prompts[0], prompts[2]]
    assert by_id.next_prompt() == prompts[0]  # looking prompts up leaves the stream where it was
    for bad in ("echo-0", "echo-x", "math-1", "echo", f"echo-{MAX_ECHO_PROMPT + 1}"):
        with pytest.raises(ValueError, match=f"'{bad}' is no echo prompt id"):
            by_id.prompt_by_id(bad)


def test_a_dataset_task_id_is_the_problem_id_and_its_prompt_is_rendered_as_the_run_renders_it(tmp_path):
    path = tmp_path / "arith.jsonl"
    rows = [{"id": "q1", "problem": "1+1", "answer": "2"}, {"id": "q2", "problem": "x" * 300, "answer": "1"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = load_run_config(overrides=[f"coordinator.task={path}", "coordinator.prompt_template='{problem}'"])
    task = build_task(config.coordinator, 256, build_tokenizer(), None)
    prompt = task.prompt_by_id("q1")
    assert prompt.prompt_id == "q1" and prompt.payload.ground_truth == "2" and prompt.data_source == "arith"
    assert (
        prompt.prompt_token_ids
        == next(p for p in iter(task.next_prompt, None) if p.payload.ground_truth == "2").prompt_token_ids
    )
    with pytest.raises(ValueError, match="no problem 'q3' in arith"):
        task.prompt_by_id("q3")
    with pytest.raises(ValueError, match="problem 'q2' has .* prompt tokens, more than the run serves"):
        task.prompt_by_id("q2")


def _session(task: EchoTask, turns: list[Turn]) -> Session:
    prompt = task.prompt_by_id("echo-2")
    group = AgentGroup("u", "team", "echo-2", 2, prompt.prompt_token_ids, 1.0, 0, 0, "echo-2", prompt)
    return Session("s", "team", group, list(prompt.prompt_token_ids), None, 0, {}, turns)


def test_the_run_scores_an_agent_session_on_its_last_generated_turn_and_refuses_unknown_ids():
    task = EchoTask(seed=0, max_tokens=4)
    tasks = AgentTasks(task, SchedulerStats())
    target = task.prompt_by_id("echo-2").payload
    other = next(t for t in range(3, 13) if t != target)
    turns = [
        Turn(True, [other] * 4, [0.0] * 4),
        Turn(False, [target] * 4, [0.0] * 4),
        Turn(True, [target, other] * 2, [0.0] * 4),
    ]
    session = _session(task, turns)
    assert asyncio.run(tasks.score(session.group.task_prompt, session)) == 0.5  # the appended tokens do not count
    assert tasks.prompt("echo-2") == session.group.task_prompt
    with pytest.raises(InvalidArgument, match=r"^task_id: 'echo-x' is no echo prompt id.* \(task echo\)$"):
        tasks.prompt("echo-x")
