"""The rollout server as a real process taking weights over the bus: whole, split (begin/load/commit), refused,
MXFP8, an IPC version over tcp, LoRA layers; and its metrics after them."""

from __future__ import annotations

import time
import urllib.request

import grpc
import numpy as np
import pytest
import redis
import torch
from prometheus_client.parser import text_string_to_metric_families

from modeling.tiny_model import init_tiny
from protos import rollout_pb2 as pb
from protos.config import LoraConfig, TrainerConfig, WeightBusConfig
from protos.redis_keys import RedisKeys
from tests.rollout_service.server_calls import (
    PROMPT,
    RUN_ID,
    generate,
    hf_greedy,
    hf_model_with,
    hf_token_logprobs,
    perturb,
    publish_and_update,
    rpc_error,
    running_server,
    server_info,
)
from tests.waiting import wait_until
from tests.weight_bus.ipc_manifests import announced_before_checksums
from trainer_service.publisher import WeightPublisher
from trainer_service.torch_backend import TorchBackend

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(init_tiny(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def server(model_dir, redis_server, tmp_path_factory):
    """One rollout server process for the whole module (engine start is the slow part)."""
    with running_server(model_dir, redis_server.url, tmp_path_factory.mktemp("logs")) as handle:
        yield handle


def test_weight_update_makes_engine_greedy_output_equal_the_trainers(server, model_dir, redis_server):
    stub = server.stub
    backend = TorchBackend(model_dir, TrainerConfig())
    before = generate(stub, max_tokens=8)[1][0]["tokens"]
    assert before == hf_greedy(backend.model, PROMPT, 8)
    perturb(backend, seed=1)
    expected = hf_greedy(backend.model, PROMPT, 8)
    assert expected != before
    client = redis.Redis.from_url(redis_server.url)
    publisher = WeightPublisher(client, RedisKeys(RUN_ID), WeightBusConfig())
    try:
        publisher.publish(1, backend.export_hf_weights())
        reply = stub.UpdateWeights(pb.UpdateWeightsRequest(version=1), timeout=60)
    finally:
        publisher.close()
    assert reply.policy_version == 1
    _, samples = generate(stub, max_tokens=8)
    assert samples[0]["tokens"] == expected
    assert [(s.version, s.start, s.end) for s in samples[0]["final"].version_spans] == [(1, 0, 8)]
    assert stub.ServerInfo(pb.ServerInfoRequest(), timeout=10).policy_version == 1


def test_an_operator_pause_outlasts_a_weight_update(server, model_dir, redis_server):
    import threading

    stub = server.stub
    version = server_info(stub).policy_version + 1
    backend = TorchBackend(model_dir, TrainerConfig())
    perturb(backend, seed=5)
    length = 250  # the longest the tiny model's 256 positions allow

    def stream(tokens: list[int], final: list) -> None:  # a request generating when the operator pauses
        request = pb.GenerateRequest(
            prompt_token_ids=PROMPT,
            sampling=pb.SamplingParams(max_tokens=length, temperature=0.0, ignore_eos=True, stream_interval=1),
        )
        for chunk in stub.Generate(request, timeout=120):
            tokens.extend(chunk.token_ids)
            final.extend([chunk] if chunk.finished else [])

    for _attempt in range(5):  # the tiny model is fast: catch a request mid-way, then pause it
        tokens, final = [], []
        reader = threading.Thread(target=stream, args=(tokens, final))
        reader.start()
        wait_until(lambda tokens=tokens: tokens, "the request generating", 30, poll_s=0.005)
        stub.Pause(pb.PauseRequest(mode=pb.PAUSE_MODE_KEEP), timeout=30)
        # kept: the chunks made before the pause are still on their way, and nothing says when the last one landed
        time.sleep(0.3)
        if server_info(stub).num_engine_requests == 1:
            break
        stub.Resume(pb.ResumeRequest(), timeout=30)
        reader.join(timeout=60)
    else:
        raise AssertionError("every request finished before the pause took hold")
    try:
        at_pause = len(tokens)
        publish_and_update(stub, redis_server, version, backend.export_hf_weights())  # pauses, loads, commits
        time.sleep(1.0)  # kept: a check that nothing happens (no token after the update) needs time to pass
        info = server_info(stub)
        # Still held: the update did not resume the engine the operator paused.
        assert info.policy_version == version and info.num_engine_requests == 1 and len(tokens) == at_pause < length
    finally:
        stub.Resume(pb.ResumeRequest(), timeout=30)
        reader.join(timeout=60)
    spans = [(s.version, s.start, s.end) for s in final[0].version_spans]
    assert len(tokens) == length and spans[-1] == (version, at_pause, length)  # the rest came after the resume


def test_split_weight_update_commits_atomically_and_refuses_steps_out_of_order(server, model_dir, redis_server):
    stub = server.stub
    current = server_info(stub).policy_version
    version = current + 1
    backend = TorchBackend(model_dir, TrainerConfig())
    perturb(backend, seed=2)
    expected = hf_greedy(backend.model, PROMPT, 8)
    publisher = WeightPublisher(redis.Redis.from_url(redis_server.url), RedisKeys(RUN_ID), WeightBusConfig())
    try:
        code, details = rpc_error(lambda: stub.CommitWeights(pb.CommitWeightsRequest(version=version), timeout=30))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "no weight update begun" in details
        code, details = rpc_error(
            lambda: stub.BeginWeightUpdate(pb.BeginWeightUpdateRequest(version=version), timeout=30)
        )
        assert code == grpc.StatusCode.NOT_FOUND and f"policy version {version}" in details

        publisher.publish(version, backend.export_hf_weights())
        begun = stub.BeginWeightUpdate(pb.BeginWeightUpdateRequest(version=version), timeout=30)
        assert begun.version == version and begun.num_tensors > 0 and begun.num_bytes > 0
        assert (server_info(stub).pending_weight_version, server_info(stub).policy_version) == (version, current)
        code, details = rpc_error(lambda: stub.CommitWeights(pb.CommitWeightsRequest(version=version), timeout=30))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "not loaded" in details

        loaded = stub.LoadWeights(pb.LoadWeightsRequest(version=version), timeout=60)
        assert loaded.num_bytes == begun.num_bytes
        # Loaded but not committed: generation goes on, all of it on the old version.
        _, samples = generate(stub, max_tokens=8)
        assert [(s.version, s.start, s.end) for s in samples[0]["final"].version_spans] == [(current, 0, 8)]

        committed = stub.CommitWeights(pb.CommitWeightsRequest(version=version), timeout=60)
        assert committed.policy_version == version and committed.paused_s > 0
        _, samples = generate(stub, max_tokens=8)
        assert samples[0]["tokens"] == expected
        assert [(s.version, s.start, s.end) for s in samples[0]["final"].version_spans] == [(version, 0, 8)]
        assert server_info(stub).pending_weight_version == 0

        code, details = rpc_error(
            lambda: stub.BeginWeightUpdate(pb.BeginWeightUpdateRequest(version=version), timeout=30)
        )
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "not newer" in details
        assert stub.AbortWeightUpdate(pb.AbortWeightUpdateRequest(), timeout=30).aborted_version == 0
    finally:
        publisher.close()


def test_corrupted_or_unreachable_version_is_refused_and_the_server_keeps_its_version(server, model_dir, redis_server):
    stub = server.stub
    current = server_info(stub).policy_version
    version = current + 1
    backend = TorchBackend(model_dir, TrainerConfig())
    perturb(backend, seed=3)
    publisher = WeightPublisher(redis.Redis.from_url(redis_server.url), RedisKeys(RUN_ID), WeightBusConfig())
    try:
        publisher.publish(version, backend.export_hf_weights())
        bucket = publisher.transport.buckets_of(version)[0]
        bucket[len(bucket) // 2] ^= 0xFF  # one flipped byte in flight
        stub.BeginWeightUpdate(pb.BeginWeightUpdateRequest(version=version), timeout=30)
        code, details = rpc_error(lambda: stub.LoadWeights(pb.LoadWeightsRequest(version=version), timeout=60))
        assert code == grpc.StatusCode.DATA_LOSS and "ChecksumError" in details
        assert (server_info(stub).pending_weight_version, server_info(stub).policy_version) == (0, current)
        code, _ = rpc_error(lambda: stub.UpdateWeights(pb.UpdateWeightsRequest(version=version), timeout=60))
        assert code == grpc.StatusCode.DATA_LOSS
    finally:
        publisher.close()
    # The manifest is still in Redis, but no publisher serves its buckets any more.
    code, details = rpc_error(lambda: stub.UpdateWeights(pb.UpdateWeightsRequest(version=version), timeout=60))
    assert code == grpc.StatusCode.UNAVAILABLE, details
    assert server_info(stub).policy_version == current
    _, samples = generate(stub, max_tokens=4)
    assert [(s.version, s.start, s.end) for s in samples[0]["final"].version_spans] == [(current, 0, 4)]


def test_metrics_endpoint_reports_throughput_ttft_rejections_and_version(server):
    stub = server.stub
    generate(stub)
    bad = pb.GenerateRequest(prompt_token_ids=[], sampling=pb.SamplingParams(max_tokens=4))
    assert rpc_error(lambda: list(stub.Generate(bad, timeout=10)))[0] == grpc.StatusCode.INVALID_ARGUMENT
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    values = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    assert values[("rollout_generated_tokens_total", ())] >= 6
    assert values[("rollout_time_to_first_token_s_count", ())] >= 1
    assert values[("rollout_requests_rejected_total", (("reason", "invalid"),))] >= 1
    assert values[("rollout_policy_version", ())] == server_info(stub).policy_version
    for name in (
        "rollout_requests_running",
        "rollout_requests_waiting",
        "rollout_kv_cache_usage_ratio",
        "rollout_weight_update_s_count",
        "rollout_weight_update_pause_s_count",
    ):
        assert (name, ()) in values, name


def test_the_server_reports_throughput_load_and_update_durations_to_the_runs_metrics_stream(
    server, model_dir, redis_server
):
    from channels.metrics_stream import MetricsStreamReader

    stub = server.stub
    client = redis.Redis.from_url(redis_server.url)
    # other modules' servers reported as test-0 to this run too: only the reports made from here on count
    newest = client.xrevrange(RedisKeys(RUN_ID).metrics("rollout"), count=1)
    start_id = newest[0][0].decode() if newest else "0"
    version = server_info(stub).policy_version + 1
    backend = TorchBackend(model_dir, TrainerConfig())
    publish_and_update(stub, redis_server, version, backend.export_hf_weights())
    generate(stub, max_tokens=32)
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    generated = next(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "rollout_generated_tokens_total"
    )
    reader = MetricsStreamReader(client, RedisKeys(RUN_ID))

    def reports_with_the_tokens() -> list:  # up to a report after the generation
        reports = [e.report for e in reader.after("rollout", start_id) if e.report and e.report.source == "test-0"]
        return reports if any(r.values["tokens_generated"] >= generated for r in reports) else []

    reports = wait_until(reports_with_the_tokens, f"a rollout report with {generated} tokens", 30, poll_s=0.5)
    latest = reports[-1]
    assert latest.role == "rollout" and latest.policy_version == version == latest.values["policy_version"]
    assert [r.step for r in reports] == sorted(r.step for r in reports)  # the server's report count
    assert any(r.values["tokens_per_s"] > 0 for r in reports)
    assert {"requests_running", "requests_waiting", "kv_cache_usage", "generate_calls"} <= set(latest.values)
    assert latest.values["weight_update_s"] >= latest.values["weight_receive_s"] > 0
    assert latest.values["weight_paused_s"] >= latest.values["weight_load_s"] > 0


def test_mxfp8_weight_update_is_dequantized_into_the_engine_and_matches_hf(server, model_dir, redis_server, tmp_path):
    from weight_bus.codecs.mxfp8 import dequantize, quantize
    from weight_bus.packing import WireCodec

    stub = server.stub
    version = server_info(stub).policy_version + 1
    backend = TorchBackend(model_dir, TrainerConfig())
    perturb(backend, seed=4)
    weights = [(name, tensor.clone()) for name, tensor in backend.export_hf_weights()]
    codec = WireCodec("mxfp8")
    assert sum(codec.quantizes(name, tensor) for name, tensor in weights) > 40
    # The reference: HF transformers with every MXFP8-eligible weight replaced by dequantize(quantize(w)).
    reference = hf_model_with(
        model_dir,
        {
            name: dequantize(*quantize(tensor), tensor.dtype) if codec.quantizes(name, tensor) else tensor
            for name, tensor in weights
        },
        tmp_path,
    )
    expected = hf_greedy(reference, PROMPT, 8)
    publisher = WeightPublisher(
        redis.Redis.from_url(redis_server.url), RedisKeys(RUN_ID), WeightBusConfig(codec="mxfp8")
    )
    try:
        publisher.publish(version, weights)
        assert publisher.last_stats.num_tensors > len(weights)  # (q, scale) pairs went on the wire
        assert stub.UpdateWeights(pb.UpdateWeightsRequest(version=version), timeout=60).policy_version == version
    finally:
        publisher.close()
    _, samples = generate(stub, max_tokens=8, logprobs=0)
    assert samples[0]["tokens"] == expected
    # The engine holds the dequantized weights, not the bf16/fp32 originals: its logprobs match the reference.
    engine_lp = samples[0]["logprobs"]
    reference_lp = hf_token_logprobs(reference, PROMPT, expected)
    original_lp = hf_token_logprobs(backend.model, PROMPT, expected)
    off_reference = max(abs(a - b) for a, b in zip(engine_lp, reference_lp, strict=False))
    off_original = max(abs(a - b) for a, b in zip(engine_lp, original_lp, strict=False))
    assert off_reference < 1e-3 and off_reference < off_original / 10, (off_reference, off_original)


def test_an_ipc_version_this_engine_cannot_open_arrives_over_tcp(server, model_dir, redis_server):
    """transport 'ipc' announces device buckets by CUDA IPC handles; an engine that cannot open them (here: no GPU)
    takes the same version over tcp, whole, instead of failing the update."""
    from protos.records import CudaIpcBucket, CudaIpcVersion, encode
    from weight_bus.sender import WeightSender

    stub = server.stub
    version = server_info(stub).policy_version + 1
    backend = TorchBackend(model_dir, TrainerConfig())
    perturb(backend, seed=7)
    expected = hf_greedy(backend.model, PROMPT, 8)
    client = redis.Redis.from_url(redis_server.url)
    keys = RedisKeys(RUN_ID)
    record = CudaIpcVersion(version, "GPU-elsewhere", 1, [CudaIpcBucket(64, 0, b"\0" * 64, 64, 0, b"", 0, b"", False)])
    client.set(keys.ipc_buckets(version), encode(record))
    sender = WeightSender(client, keys, WeightBusConfig(), transport="ipc")  # the tcp side of an ipc publisher
    try:
        sender.publish(version, backend.export_hf_weights())
        assert stub.UpdateWeights(pb.UpdateWeightsRequest(version=version), timeout=60).policy_version == version
    finally:
        sender.close()
    _, samples = generate(stub, max_tokens=8)
    assert samples[0]["tokens"] == expected
    info = server_info(stub)
    assert info.last_weight_source == "publisher" and info.last_weight_update_s > 0  # tcp, not the IPC handles


def test_an_ipc_version_announced_before_its_checksums_arrives_over_tcp_once_they_are_stored(
    server, model_dir, redis_server
):
    """The ipc publisher announces a version before its host copy (``checksummed=False``); an engine that cannot open
    the handles waits for the checksummed manifest the host mirror stores, then receives and verifies it over tcp."""
    import threading

    from channels.version_board import VersionBoard
    from protos.records import CudaIpcBucket, CudaIpcVersion, encode
    from weight_bus import packing
    from weight_bus.ipc import HostMirror
    from weight_bus.sender import WeightSender

    stub = server.stub
    version = server_info(stub).policy_version + 1
    backend = TorchBackend(model_dir, TrainerConfig())
    perturb(backend, seed=11)
    expected = hf_greedy(backend.model, PROMPT, 8)
    client = redis.Redis.from_url(redis_server.url)
    keys = RedisKeys(RUN_ID)
    record = CudaIpcVersion(version, "GPU-elsewhere", 1, [CudaIpcBucket(64, 0, b"\0" * 64, 64, 0, b"", 0, b"", False)])
    client.set(keys.ipc_buckets(version), encode(record))
    sender = WeightSender(client, keys, WeightBusConfig(), transport="ipc", recycle=False)
    mirror = HostMirror(sender, torch.device("cpu"))
    replies = []
    try:
        manifest, buckets = packing.pack(list(backend.export_hf_weights()), version, 2**20)
        unchecked = announced_before_checksums(manifest, sender.tcp.address)
        VersionBoard(client, keys).publish_manifest(unchecked)
        update = threading.Thread(
            target=lambda: replies.append(stub.UpdateWeights(pb.UpdateWeightsRequest(version=version), timeout=60))
        )
        update.start()
        mirror.submit(unchecked, [torch.from_numpy(np.asarray(b)) for b in buckets])
        update.join(timeout=90)
        assert replies and replies[0].policy_version == version
    finally:
        mirror.close()
        sender.close()
    _, samples = generate(stub, max_tokens=8)
    assert samples[0]["tokens"] == expected
    assert server_info(stub).last_weight_source == "publisher"


@pytest.mark.parametrize("target_modules", [["linear_qkv", "linear_fc2"], ["linear_proj", "linear_fc1"]])
def test_lora_update_of_the_adapted_layers_only_matches_the_merged_model(
    server, model_dir, redis_server, target_modules
):
    """A LoRA trainer publishes only the adapted layers; the engine keeps the rest and equals HF's merged model."""
    stub = server.stub
    version = server_info(stub).policy_version + 1
    full = list(TorchBackend(model_dir, TrainerConfig()).export_hf_weights())
    publish_and_update(stub, redis_server, version, full)
    base_tokens = generate(stub, max_tokens=8)[1][0]["tokens"]
    backend = TorchBackend(model_dir, TrainerConfig(lora=LoraConfig(rank=4, alpha=8, target_modules=target_modules)))
    torch.manual_seed(7)
    with torch.no_grad():  # adapters as if trained: B away from zero
        for param in backend.trainable:
            param.add_(torch.randn_like(param) * 0.5)
    weights = list(backend.export_hf_weights())
    assert 0 < len(weights) < len(full)
    expected = hf_greedy(backend.model, PROMPT, 8)
    assert expected != base_tokens
    publish_and_update(stub, redis_server, version + 1, weights)
    _, samples = generate(stub, max_tokens=8, logprobs=0)
    assert samples[0]["tokens"] == expected
    off = max(
        abs(a - b)
        for a, b in zip(samples[0]["logprobs"], hf_token_logprobs(backend.model, PROMPT, expected), strict=False)
    )
    assert off < 1e-3, off
