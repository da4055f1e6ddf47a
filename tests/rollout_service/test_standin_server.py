"""Stand-in rollout servers (synthetic engine) through the coordinator's real gRPC client, with real valkey: generate
streams, health, ServerInfo, version reports after a weight announcement, INVALID_ARGUMENT for bad input; the
many-servers host (``rollout_service.standin_fleet``) and a single ``rollout_service serve`` on the stand-in."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from channels.version_board import VersionBoard
from coordinator.rollout_client import RolloutClient, RolloutRejected
from protos.config import SamplingConfig
from protos.records import FinishReason, WeightManifest
from protos.redis_keys import RedisKeys
from rollout_service import standin_fleet
from tests.rollout_service.server_process import spawn_rollout_server, stop_process
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

RUN_ID = "standin-test"
KEYS = RedisKeys(RUN_ID)
PROMPT = [1, 4, 5, 6]
SAMPLING = SamplingConfig(max_tokens=24, temperature=1.0)


@pytest.fixture
def fleet(redis_url, tmp_path):
    """Two stand-ins following RUN_ID, fast and with routes of 2 layers x top-2 of 8 experts."""
    spawned = standin_fleet.spawn(
        2,
        tmp_path / "fleet.log",
        "--redis-url",
        redis_url,
        "--run-id",
        RUN_ID,
        "rollout.synthetic.tokens_per_s=2000",
        "rollout.synthetic.moe_layers=2",
    )
    try:
        spawned.wait_serving(timeout_s=120)
        yield spawned
    finally:
        assert spawned.stop() == 0, spawned.log_path.read_text()[-3000:]


async def with_client(address: str, call):
    client = RolloutClient(address)
    try:
        return await call(client)
    finally:
        await client.close()


def publish_empty_version(redis_url: str, version: int) -> None:
    """What a trainer publishes, with no tensors: the stand-ins label the version without fetching bytes."""
    manifest = WeightManifest(version, [], [], "", "tcp", time.time())
    VersionBoard(redis.Redis.from_url(redis_url), KEYS).publish_manifest(manifest)


def test_a_stand_in_streams_samples_through_the_rollout_client(fleet):
    async def generate(client: RolloutClient):
        healthy = await client.check_health()
        info = await client.info()
        results = await client.generate(PROMPT, 4, SAMPLING, timeout_s=30, request_id="g1")
        return healthy, info, results

    healthy, info, results = asyncio.run(with_client(fleet.addresses[0], generate))
    assert healthy and info.server_id == "standin-0" and info.policy_version == 0
    assert info.vocab_size == 64 and info.routed_experts_available
    assert len(results) == 4
    for result in results:
        assert len(result.token_ids) == len(result.logprobs) == 24
        assert result.finish_reason == FinishReason.LENGTH
        assert result.version_spans == [(0, 0, 24)]
        assert result.routed_experts.shape == (len(PROMPT) + 24 - 1, 2, 2)
    assert len({tuple(result.token_ids) for result in results}) == 4


def test_stand_ins_report_a_published_version_and_label_tokens_with_it(fleet, redis_url):
    publish_empty_version(redis_url, 1)
    board = VersionBoard(redis.Redis.from_url(redis_url), KEYS)
    reported = lambda: {report.policy_version for report in board.fleet_reports().values()} == {1}
    wait_until(reported, "every stand-in reporting v1", 30, poll_s=0.1)
    assert sorted(board.fleet_reports()) == ["standin-0", "standin-1"]

    async def after_update(rollout: RolloutClient):
        info = await rollout.info()
        results = await rollout.generate(PROMPT, 1, SAMPLING, timeout_s=30)
        return info, results

    info, results = asyncio.run(with_client(fleet.addresses[1], after_update))
    assert info.policy_version == 1 and info.last_weight_source == "synthetic"
    assert results[0].version_spans == [(1, 0, 24)]


def test_bad_input_to_a_stand_in_is_invalid_argument(fleet):
    async def bad_requests(client: RolloutClient):
        refusals = []
        for prompt, sampling in (
            ([1, 64], SAMPLING),  # id outside the synthetic vocabulary of 64
            (PROMPT, SamplingConfig(max_tokens=400, temperature=1.0)),  # beyond rollout.max_model_len 256
        ):
            with pytest.raises(RolloutRejected) as refused:
                await client.generate(prompt, 1, sampling, timeout_s=30)
            refusals.append(str(refused.value))
        return refusals

    vocabulary, length = asyncio.run(with_client(fleet.addresses[0], bad_requests))
    assert "prompt_token_ids" in vocabulary and "[0, 64)" in vocabulary
    assert "max_tokens" in length


def test_the_fleet_host_serves_n_distinct_servers_and_stops_cleanly(tmp_path):
    spawned = standin_fleet.spawn(8, tmp_path / "fleet8.log")
    try:
        addresses = spawned.wait_serving(timeout_s=120)

        async def identify(address: str):
            return await with_client(address, lambda c: asyncio.gather(c.check_health(), c.info()))

        async def all_servers():
            return await asyncio.gather(*(identify(address) for address in addresses))

        replies = asyncio.run(all_servers())
    finally:
        code = spawned.stop()
    assert len(set(addresses)) == 8
    assert all(healthy for healthy, _ in replies)
    assert sorted(info.server_id for _, info in replies) == sorted(f"standin-{i}" for i in range(8))
    assert code == 0 and "8 stand-in servers stopped" in spawned.log_path.read_text()


def test_rollout_serve_runs_the_stand_in_without_a_model(tmp_path):
    server = spawn_rollout_server("", tmp_path / "serve.log", "--server-id", "solo", "rollout.engine=synthetic")
    try:
        server.wait_serving(timeout_s=120)

        async def call(client: RolloutClient):
            return await client.info(), await client.generate(PROMPT, 2, SAMPLING, timeout_s=30)

        info, results = asyncio.run(with_client(server.address, call))
    finally:
        stop_process(server.process)
    assert info.server_id == "solo" and info.model == "synthetic"
    assert [len(result.token_ids) for result in results] == [24, 24]
    assert server.process.returncode == 0
