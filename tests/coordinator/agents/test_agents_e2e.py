"""External agents end to end, every part its own process: a rollout server (vLLM CPU, tiny model), the
coordinator serving the agent API over TLS, the example agent, and an agent killed mid-session.

What reaches the trajectory stream is read from Redis; the coordinator's own counters from its metrics reports.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import redis
import yaml

from fleetrl.agent import AgentClient, InvalidArgument, Unauthenticated
from launcher.redis_server import free_port
from protos import agent_pb2 as pb
from protos import agent_pb2_grpc as pb_grpc
from protos.records import decode_metrics
from protos.redis_keys import RedisKeys
from tests.coordinator.agents.agent_processes import REPO_ROOT, agents_only_config, queued, start_coordinator
from tests.rollout_service.server_process import stop_process
from tests.waiting import wait_until

pytestmark = pytest.mark.e2e

RUN_ID = "agents-e2e"
KEYS = RedisKeys(RUN_ID)
TOKEN = "e2e-agent-token"
PROMPT = [1, 4, 5, 6]  # <bos> 1 2 3 in the tiny echo vocabulary
# A second agent: opens a session, generates one turn, says so, then hangs until it is killed.
VICTIM = """
import signal, sys
from fleetrl.agent import AgentClient
with AgentClient(sys.argv[1], sys.argv[2], tls_ca_file=sys.argv[3]) as client:
    session = client.open_session([1, 7, 8, 9], group_key="victim", group_size=2)
    session.generate(4)
    print("generated", flush=True)
    signal.pause()
"""


@pytest.fixture
def coordinator(rollout_server, redis_url, tls_pair, tmp_path):
    """The coordinator process serving the agent API only (TLS, one token), groups of 2, one group per step."""
    cert, key = tls_pair
    tokens = tmp_path / "tokens.yaml"
    grant = {"name": "e2e", "token": TOKEN, "scopes": ["generate", "submit"], "rate_per_s": 1000}
    tokens.write_text(yaml.safe_dump({"tokens": [grant]}))
    port = free_port()
    config = agents_only_config(
        RUN_ID, redis_url, port, tokens, tls_cert_file=cert, tls_key_file=key, session_timeout_s=2.0
    )
    process, _ = start_coordinator(config, tmp_path, rollout_server.address)
    try:
        yield f"127.0.0.1:{port}", cert
    finally:
        stop_process(process)


def _coordinator_value(redis_url: str, key: str) -> float:
    entries = redis.Redis.from_url(redis_url).xrevrange(KEYS.metrics("coordinator"), count=1)
    return decode_metrics(entries[0][1][b"m"]).values.get(key, -1) if entries else -1


def test_agents_in_processes_train_through_tls_and_a_killed_one_leaves_nothing_queued(coordinator, redis_url):
    address, ca = coordinator
    env = {**os.environ, "FLEETRL_TOKEN": TOKEN, "PYTHONPATH": str(REPO_ROOT)}
    victim = subprocess.Popen(
        [sys.executable, "-c", VICTIM, address, TOKEN, ca], stdout=subprocess.PIPE, env=env, start_new_session=True
    )
    example = subprocess.Popen(
        [sys.executable, "examples/calculator_agent.py", "--address", address, "--tls-ca-file", ca]
        + ["--sessions", "4", "--group-size", "2", "--concurrency", "4"],
        stdout=subprocess.PIPE,
        env=env,
        cwd=REPO_ROOT,
    )
    assert victim.stdout.readline().strip() == b"generated"  # mid-session: one turn recorded, nothing submitted
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    out, _ = example.communicate(timeout=300)
    assert example.returncode == 0
    summary = json.loads(out.decode().strip().splitlines()[-1])
    assert summary["sessions_submitted"] == 4 and summary["groups_queued"] == 2
    # the killed agent's session is abandoned after agent.session_timeout_s; its group is dropped, never queued
    wait_until(lambda: _coordinator_value(redis_url, "agent_groups_dropped") == 1, "the victim's group dropped", 60)
    groups = queued(redis_url, KEYS)
    assert len(groups) == 2 and not any("victim" in g.prompt_id for g in groups)
    assert all(len(g.samples) == 2 and g.samples[0].loss_mask is not None for g in groups)

    # the same server refuses a wrong or missing token, a forged submission, a plaintext client; nothing is written
    with AgentClient(address, "wrong", tls_ca_file=ca) as client, pytest.raises(Unauthenticated):
        client.open_session(PROMPT, group_key="refused", group_size=2)
    credentials = grpc.ssl_channel_credentials(Path(ca).read_bytes())
    with grpc.secure_channel(address, credentials) as channel:  # no token at all (the SDK refuses to send none)
        with pytest.raises(grpc.RpcError) as missing:
            request = pb.OpenSessionRequest(prompt_token_ids=PROMPT, group_key="refused", group_size=2)
            pb_grpc.AgentServiceStub(channel).OpenSession(request, timeout=10)
        assert missing.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with AgentClient(address, TOKEN, tls_ca_file=ca) as client:
        session = client.open_session(PROMPT, group_key="forged", group_size=2)
        session.generate(4)
        with pytest.raises(InvalidArgument):
            session.submit(1.0, expected_token_ids=[*session.token_ids[:-1], session.token_ids[-1] ^ 1])
        session.abandon()
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.AgentServiceStub(channel)
        with pytest.raises(grpc.RpcError) as plaintext:
            stub.OpenSession(pb.OpenSessionRequest(prompt_token_ids=PROMPT, group_key="plain"), timeout=5)
        assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE
    assert len(queued(redis_url, KEYS)) == 2
