"""examples/calculator_agent.py as its own process against the scripted agent server: every group is filled
and queued, tool results are appended between generated turns, and the rewards it submits are the echo reward
of each session's final turn."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from scripted_agent_server import TOKEN, ScriptedAgentService, ServerThread

from protos import agent_pb2

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[3]
EQUALS_ID, DIGIT_IDS = 40, list(range(3, 13))


@pytest.fixture
def server():
    thread = ServerThread(ScriptedAgentService()).start()
    try:
        yield thread
    finally:
        thread.stop()


def test_calculator_agent_fills_groups_and_submits_the_echo_reward_of_its_final_turn(server):
    command = [sys.executable, "examples/calculator_agent.py", "--address", server.address]
    command += ["--token-env", "AGENT_TOKEN", "--sessions", "6", "--group-size", "3", "--concurrency", "3"]
    env = {**os.environ, "AGENT_TOKEN": TOKEN, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["sessions_submitted"] == 6 and summary["groups_queued"] == 2 and summary["sessions_failed"] == 0

    sessions = list(server.servicer.sessions.values())
    assert all(s.state == agent_pb2.SESSION_STATE_SUBMITTED for s in sessions) and len(sessions) == 6
    for session in sessions:
        assert session.prompt[0] == 1 and len(session.prompt) == 4
        generated = [t for t in session.turns if t.generated]
        assert 1 <= len(generated) <= 3 and session.turns[-1].generated
        for turn in session.turns:
            if not turn.generated:
                assert list(turn.token_ids) == [EQUALS_ID, *session.prompt[1:]]  # "= n * 1"
        context = session.token_ids()[: session.length - len(session.turns[-1].token_ids)]
        target = next(t for t in reversed(context) if t in DIGIT_IDS)
        expected = sum(1 for t in session.turns[-1].token_ids[:8] if t == target) / 8
        assert session.reward == pytest.approx(expected)
    rewards = [s.reward for s in sessions]
    assert all(reward == 0.25 for reward in rewards)  # the scripted model echoes the last token at 2 of 8 places
    assert summary["mean_reward"] == pytest.approx(sum(rewards) / len(rewards))
