"""A coordinator killed with SIGKILL mid-session and restarted serves the same agent sessions: every part its own
process (rollout server, coordinator, valkey), the agent in this process through the SDK.

The agent keeps its client across the kill: a Generate sent while the coordinator is down is retried by the SDK
and lands on the restarted one; a replayed Submit keeps its first answer; the group is queued once, also across a
second kill after it was queued; the restored group keeps the only slot max_staleness 0 allows.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest
import yaml

from fleetrl.agent import AdmissionTimeout, AgentClient, GroupState, RetryPolicy
from launcher.redis_server import free_port
from modeling.tiny_model import BOS_ID, DIGIT_IDS
from protos.redis_keys import RedisKeys
from tests.coordinator.agents.agent_processes import agents_only_config, queued, start_coordinator
from tests.rollout_service.server_process import stop_process

pytestmark = pytest.mark.e2e

RUN_ID = "agents-restart"
KEYS = RedisKeys(RUN_ID)
TOKEN = "restart-token"
PROMPT = [BOS_ID, DIGIT_IDS[4], DIGIT_IDS[0], DIGIT_IDS[9]]
# Retries that outlast a coordinator restart (a few seconds here; well under a minute on a busy machine).
PATIENT = RetryPolicy(max_attempts=150, initial_backoff_s=0.2, max_backoff_s=1.0, admission_timeout_s=1.0)


@pytest.fixture
def restartable(rollout_server, redis_url, tmp_path):
    """``start(log_name)`` starts the coordinator (agents only, max_staleness 0, a fixed port); ``kill()`` kills it
    with SIGKILL. Yields (address, start, kill)."""
    tokens = tmp_path / "tokens.yaml"
    grant = {"name": "restart", "token": TOKEN, "scopes": ["generate", "submit"], "rate_per_s": 1000}
    tokens.write_text(yaml.safe_dump({"tokens": [grant]}))
    port = free_port()
    config = agents_only_config(RUN_ID, redis_url, port, tokens, max_staleness=0)
    running: list = []

    def start(log_name: str) -> None:
        running.append(start_coordinator(config, tmp_path, rollout_server.address, log_name)[0])

    def kill() -> None:
        process = running.pop()
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)

    try:
        yield f"127.0.0.1:{port}", start, kill
    finally:
        for process in running:
            stop_process(process)


def test_a_coordinator_killed_mid_session_serves_the_same_sessions_after_its_restart(restartable, redis_url):
    address, start, kill = restartable
    start("coordinator-1.log")
    with AgentClient(address, TOKEN, retry=PATIENT) as client:
        first = client.open_session(PROMPT, group_key="g", group_size=2)
        second = client.open_session(PROMPT, group_key="g", group_size=2)
        first.generate(4)
        first.append([DIGIT_IDS[9]])
        first.generate(4)
        second.generate(4)
        assert first.submit(reward=0.25).group_state is GroupState.WAITING

        kill()  # mid-session: one session submitted, the other open; nothing queued
        turns = []
        generating = threading.Thread(target=lambda: turns.append(second.generate(4)))  # sent while it is down
        generating.start()
        start("coordinator-2.log")
        generating.join(timeout=120)
        assert turns and turns[0].turn_index == 1 and not turns[0].recovered

        info = first.get_info()  # the record came back whole, version spans included
        assert list(info.prompt_token_ids) + [t for turn in info.turns for t in turn.token_ids] == first.token_ids
        assert [len(turn.version_spans) for turn in info.turns] == [1, 0, 1]
        replay = first.submit(reward=0.25)  # the same submission id: its first answer, not a second submission
        assert (replay.group_state, replay.sessions_submitted) == (GroupState.WAITING, 1)
        with pytest.raises(AdmissionTimeout):  # the restored group holds the one slot max_staleness 0 allows
            client.open_session(PROMPT, group_key="other", group_size=2)
        done = second.submit(reward=0.75)
        assert done.group_state is GroupState.QUEUED

        kill()  # after the push: a third coordinator must not push it again
        start("coordinator-3.log")
        again = second.submit(reward=0.75)
        assert (again.group_state, again.group_id) == (GroupState.QUEUED, done.group_id)

    [group] = queued(redis_url, KEYS)
    assert group.group_id == done.group_id
    by_reward = {sample.reward: sample for sample in group.samples}
    assert sorted(by_reward) == [0.25, 0.75]
    assert list(by_reward[0.25].response_token_ids.to_numpy()) == first.token_ids[len(PROMPT) :]
    assert list(by_reward[0.75].response_token_ids.to_numpy()) == second.token_ids[len(PROMPT) :]
    assert list(by_reward[0.25].loss_mask.to_numpy()).count(0) == 1  # the appended tool token
