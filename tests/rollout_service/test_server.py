"""The rollout server as a real process: vLLM CPU engine, gRPC on loopback, weights over the bus."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass

import grpc
import pytest
import redis
import torch
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from coordinator.redis_server import free_port
from modeling.tiny_model import init_tiny
from protos import rollout_pb2 as pb
from protos import rollout_pb2_grpc as pb_grpc
from protos.config import LoraConfig, TrainerConfig, WeightBusConfig
from protos.redis_keys import RedisKeys
from tests.rollout_service.server_process import spawn_rollout_server
from trainer_service.publisher import WeightPublisher
from trainer_service.torch_backend import TorchBackend

pytestmark = pytest.mark.integration

PROMPT = [1, 4, 5, 6]
RUN_ID = "rollout-test"
MAX_INFLIGHT = 4
GRACE_S = 20.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(init_tiny(tmp_path_factory.mktemp("tiny")))


@dataclass
class ServerHandle:
    channel: grpc.Channel
    stub: pb_grpc.RolloutServiceStub
    process: subprocess.Popen
    metrics_port: int
    log_path: str


@pytest.fixture(scope="module")
def server(model_dir, redis_server, tmp_path_factory):
    """One rollout server process for the whole module (engine start is the slow part)."""
    metrics_port = free_port()
    log_path = tmp_path_factory.mktemp("logs") / "rollout.log"
    # manual: weights change only through the gRPC calls the tests make, never on an announcement
    spawned = spawn_rollout_server(
        model_dir,
        log_path,
        "--server-id",
        "test-0",
        "--redis-url",
        redis_server.url,
        "--run-id",
        RUN_ID,
        "--metrics-port",
        str(metrics_port),
        "--grace-s",
        str(GRACE_S),
        f"rollout.max_inflight_requests={MAX_INFLIGHT}",
        "rollout.weight_updates=manual",
    )
    process = spawned.process
    channel = grpc.insecure_channel(spawned.wait_serving(timeout_s=240).address)
    server_handle = ServerHandle(channel, pb_grpc.RolloutServiceStub(channel), process, metrics_port, str(log_path))
    yield server_handle
    channel.close()
    if process.poll() is None:  # the shutdown test normally stops it
        os.killpg(process.pid, 15)
        process.wait(timeout=60)


def _generate(stub, prompt=PROMPT, **sampling):
    params = {"n": 1, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True, **sampling}
    chunks = list(
        stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(**params)), timeout=60)
    )
    samples: dict[int, dict] = {}
    for chunk in chunks:
        sample = samples.setdefault(chunk.sample_index, {"tokens": [], "logprobs": [], "final": None})
        sample["tokens"] += list(chunk.token_ids)
        sample["logprobs"] += list(chunk.logprobs)
        if chunk.finished:
            sample["final"] = chunk
    return chunks, samples


def test_generate_streams_tokens_logprobs_and_version_spans(server):
    stub = server.stub
    chunks, samples = _generate(stub, n=3, temperature=1.0, max_tokens=6)
    assert len(chunks) > 3  # streamed in pieces, not one message per sample
    assert sorted(samples) == [0, 1, 2]
    for sample in samples.values():
        assert len(sample["tokens"]) == 6 and len(sample["logprobs"]) == 6
        assert all(lp <= 0.0 for lp in sample["logprobs"])
        final = sample["final"]
        assert final.finish_reason == pb.FINISH_REASON_LENGTH
        assert [(s.version, s.start, s.end) for s in final.version_spans] == [(0, 0, 6)]
        assert not final.HasField("routed_experts")  # vLLM on CPU cannot return routes


def test_logprobs_are_of_the_distribution_the_tokens_were_sampled_from(server, model_dir):
    """At temperature T the sampler draws from softmax(logits / T): the logprobs must be of that distribution
    (vLLM's default returns those of the raw logits), or every off-policy ratio at T != 1 is off."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()  # the weights served now
    _, samples = _generate(server.stub, n=2, temperature=0.5, max_tokens=6)
    for sample in samples.values():
        ids = torch.tensor([PROMPT + sample["tokens"]])
        with torch.no_grad():
            logits = reference(input_ids=ids).logits[0, len(PROMPT) - 1 : -1].float()
        tokens = torch.tensor(sample["tokens"])[:, None]
        at_temperature = torch.log_softmax(logits / 0.5, dim=-1).gather(1, tokens)[:, 0]
        raw = torch.log_softmax(logits, dim=-1).gather(1, tokens)[:, 0]
        served = torch.tensor(sample["logprobs"])
        assert (served - at_temperature).abs().max() < 1e-3 < (raw - at_temperature).abs().max(), (served, raw)


def test_stream_interval_sends_fewer_larger_chunks_with_every_token(server):
    chunks, samples = _generate(server.stub, n=2, temperature=1.0, max_tokens=12, stream_interval=4)
    for index, sample in samples.items():
        sizes = [len(c.token_ids) for c in chunks if c.sample_index == index]
        assert sum(sizes) == 12 and len(sample["logprobs"]) == 12
        assert sizes[0] == 1 and len(sizes) <= 5  # the first token at once, then about 4 at a time


def test_health_reflection_and_server_info(server):
    channel, stub = server.channel, server.stub
    info = stub.ServerInfo(pb.ServerInfoRequest(), timeout=10)
    assert info.vocab_size == 64 and info.max_model_len == 256 and not info.routed_experts_available
    reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for reply in replies for s in reply.list_services_response.service}
    assert "fleetrl.rollout.v1.RolloutService" in names and "grpc.health.v1.Health" in names


MALFORMED = [
    ({"prompt_token_ids": []}, "prompt_token_ids"),
    ({"prompt_token_ids": [1, 999]}, "vocabulary"),
    ({"prompt_token_ids": [-3]}, "vocabulary"),
    ({"sampling": {"max_tokens": -1}}, "max_tokens"),
    ({"sampling": {"max_tokens": 10**6}}, "model length"),
    ({"sampling": {"max_tokens": 4, "n": 10**4}}, "sampling.n"),
    ({"sampling": {"max_tokens": 4, "temperature": -0.5}}, "temperature"),
    ({"sampling": {"max_tokens": 4, "temperature": float("nan")}}, "temperature"),
    ({"sampling": {"max_tokens": 4, "n": 2, "temperature": 0.0}}, "temperature > 0"),
    ({"sampling": {"max_tokens": 4, "top_p": 1.5}}, "top_p"),
    ({"sampling": {"max_tokens": 4, "top_p": -0.1}}, "top_p"),
    ({"sampling": {"max_tokens": 4, "min_p": 2.0}}, "min_p"),
    ({"sampling": {"max_tokens": 4, "top_k": -7}}, "top_k"),
    ({"sampling": {"max_tokens": 4, "logprobs": 1000}}, "logprobs"),
    ({"sampling": {"max_tokens": 4, "stop_token_ids": [70000]}}, "stop_token_ids"),
    ({"request_id": "x" * 1000, "sampling": {"max_tokens": 4}}, "request_id"),
    ({"sampling": {"max_tokens": 4, "stream_interval": 100000}}, "stream_interval"),
]


def test_malformed_requests_get_invalid_argument_and_server_keeps_serving(server):
    stub = server.stub
    for fields, needle in MALFORMED:
        request = pb.GenerateRequest(prompt_token_ids=fields.get("prompt_token_ids", PROMPT))
        if "request_id" in fields:
            request.request_id = fields["request_id"]
        request.sampling.CopyFrom(pb.SamplingParams(**fields.get("sampling", {"max_tokens": 4})))
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(request, timeout=30))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, fields
        assert needle in caught.value.details(), (needle, caught.value.details())
    with pytest.raises(grpc.RpcError) as caught:
        stub.Pause(pb.PauseRequest(mode=99), timeout=10)  # unknown enum value
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    oversized = pb.GenerateRequest(prompt_token_ids=[1] * (9 * 1024 * 1024), sampling=pb.SamplingParams(max_tokens=4))
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(oversized, timeout=30))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    _, samples = _generate(stub)
    assert len(samples[0]["tokens"]) == 6


def _hf_greedy(model, prompt, num_tokens):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=num_tokens,
            min_new_tokens=num_tokens,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def _perturb(backend: TorchBackend, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():  # a large random step, as if trained, that changes the greedy output
        for param in backend.model.parameters():
            param.add_(torch.randn_like(param) * param.std().clamp(min=0.05))


def _error(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value.code(), caught.value.details()


def _info(stub) -> pb.ServerInfoResponse:
    return stub.ServerInfo(pb.ServerInfoRequest(), timeout=10)


def test_weight_update_makes_engine_greedy_output_equal_the_trainers(server, model_dir, redis_server):
    stub = server.stub
    backend = TorchBackend(model_dir, TrainerConfig())
    before = _generate(stub, max_tokens=8)[1][0]["tokens"]
    assert before == _hf_greedy(backend.model, PROMPT, 8)
    _perturb(backend, seed=1)
    expected = _hf_greedy(backend.model, PROMPT, 8)
    assert expected != before
    client = redis.Redis.from_url(redis_server.url)
    publisher = WeightPublisher(client, RedisKeys(RUN_ID), WeightBusConfig())
    try:
        publisher.publish(1, backend.export_hf_weights())
        reply = stub.UpdateWeights(pb.UpdateWeightsRequest(version=1), timeout=60)
    finally:
        publisher.close()
    assert reply.policy_version == 1
    _, samples = _generate(stub, max_tokens=8)
    assert samples[0]["tokens"] == expected
    assert [(s.version, s.start, s.end) for s in samples[0]["final"].version_spans] == [(1, 0, 8)]
    assert stub.ServerInfo(pb.ServerInfoRequest(), timeout=10).policy_version == 1


def test_requests_beyond_the_inflight_limit_get_resource_exhausted_and_cancel_frees_slots(server):
    stub = server.stub
    long = pb.GenerateRequest(prompt_token_ids=PROMPT, sampling=pb.SamplingParams(max_tokens=240, ignore_eos=True))
    # Paused (keep): admitted requests stay in flight instead of racing to finish.
    stub.Pause(pb.PauseRequest(mode=pb.PAUSE_MODE_KEEP), timeout=30)
    calls = [stub.Generate(long, timeout=120) for _ in range(MAX_INFLIGHT)]
    deadline = time.monotonic() + 30
    while stub.ServerInfo(pb.ServerInfoRequest(), timeout=10).num_running < MAX_INFLIGHT:
        assert time.monotonic() < deadline, "the calls were not admitted"
        time.sleep(0.05)
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(long, timeout=30))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "in flight" in caught.value.details()
    for call in calls:
        call.cancel()  # a client that cancels aborts its engine request and frees its slot
    stub.Resume(pb.ResumeRequest(), timeout=30)
    deadline = time.monotonic() + 30
    while stub.ServerInfo(pb.ServerInfoRequest(), timeout=10).num_running:
        assert time.monotonic() < deadline, "cancelled calls still counted as running"
        time.sleep(0.1)
    _, samples = _generate(stub)
    assert len(samples[0]["tokens"]) == 6


def test_an_operator_pause_outlasts_a_weight_update(server, model_dir, redis_server):
    import threading

    stub = server.stub
    version = _info(stub).policy_version + 1
    backend = TorchBackend(model_dir, TrainerConfig())
    _perturb(backend, seed=5)
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
        deadline = time.monotonic() + 30
        while not tokens:
            assert time.monotonic() < deadline, "the request generated nothing"
            time.sleep(0.005)
        stub.Pause(pb.PauseRequest(mode=pb.PAUSE_MODE_KEEP), timeout=30)
        time.sleep(0.3)  # the chunks made before the pause arrive
        if _info(stub).num_engine_requests == 1:
            break
        stub.Resume(pb.ResumeRequest(), timeout=30)
        reader.join(timeout=60)
    else:
        raise AssertionError("every request finished before the pause took hold")
    try:
        at_pause = len(tokens)
        _publish_and_update(stub, redis_server, version, backend.export_hf_weights())  # pauses, loads, commits
        time.sleep(1.0)
        info = _info(stub)
        # Still held: the update did not resume the engine the operator paused.
        assert info.policy_version == version and info.num_engine_requests == 1 and len(tokens) == at_pause < length
    finally:
        stub.Resume(pb.ResumeRequest(), timeout=30)
        reader.join(timeout=60)
    spans = [(s.version, s.start, s.end) for s in final[0].version_spans]
    assert len(tokens) == length and spans[-1] == (version, at_pause, length)  # the rest came after the resume


def test_split_weight_update_commits_atomically_and_refuses_steps_out_of_order(server, model_dir, redis_server):
    stub = server.stub
    current = _info(stub).policy_version
    version = current + 1
    backend = TorchBackend(model_dir, TrainerConfig())
    _perturb(backend, seed=2)
    expected = _hf_greedy(backend.model, PROMPT, 8)
    publisher = WeightPublisher(redis.Redis.from_url(redis_server.url), RedisKeys(RUN_ID), WeightBusConfig())
    try:
        code, details = _error(lambda: stub.CommitWeights(pb.CommitWeightsRequest(version=version), timeout=30))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "no weight update begun" in details
        code, details = _error(lambda: stub.BeginWeightUpdate(pb.BeginWeightUpdateRequest(version=version), timeout=30))
        assert code == grpc.StatusCode.NOT_FOUND and f"policy version {version}" in details

        publisher.publish(version, backend.export_hf_weights())
        begun = stub.BeginWeightUpdate(pb.BeginWeightUpdateRequest(version=version), timeout=30)
        assert begun.version == version and begun.num_tensors > 0 and begun.num_bytes > 0
        assert (_info(stub).pending_weight_version, _info(stub).policy_version) == (version, current)
        code, details = _error(lambda: stub.CommitWeights(pb.CommitWeightsRequest(version=version), timeout=30))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "not loaded" in details

        loaded = stub.LoadWeights(pb.LoadWeightsRequest(version=version), timeout=60)
        assert loaded.num_bytes == begun.num_bytes
        # Loaded but not committed: generation goes on, all of it on the old version.
        _, samples = _generate(stub, max_tokens=8)
        assert [(s.version, s.start, s.end) for s in samples[0]["final"].version_spans] == [(current, 0, 8)]

        committed = stub.CommitWeights(pb.CommitWeightsRequest(version=version), timeout=60)
        assert committed.policy_version == version and committed.paused_s > 0
        _, samples = _generate(stub, max_tokens=8)
        assert samples[0]["tokens"] == expected
        assert [(s.version, s.start, s.end) for s in samples[0]["final"].version_spans] == [(version, 0, 8)]
        assert _info(stub).pending_weight_version == 0

        code, details = _error(lambda: stub.BeginWeightUpdate(pb.BeginWeightUpdateRequest(version=version), timeout=30))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "not newer" in details
        assert stub.AbortWeightUpdate(pb.AbortWeightUpdateRequest(), timeout=30).aborted_version == 0
    finally:
        publisher.close()


def test_corrupted_or_unreachable_version_is_refused_and_the_server_keeps_its_version(server, model_dir, redis_server):
    stub = server.stub
    current = _info(stub).policy_version
    version = current + 1
    backend = TorchBackend(model_dir, TrainerConfig())
    _perturb(backend, seed=3)
    publisher = WeightPublisher(redis.Redis.from_url(redis_server.url), RedisKeys(RUN_ID), WeightBusConfig())
    try:
        publisher.publish(version, backend.export_hf_weights())
        bucket = publisher.transport.buckets_of(version)[0]
        bucket[len(bucket) // 2] ^= 0xFF  # one flipped byte in flight
        stub.BeginWeightUpdate(pb.BeginWeightUpdateRequest(version=version), timeout=30)
        code, details = _error(lambda: stub.LoadWeights(pb.LoadWeightsRequest(version=version), timeout=60))
        assert code == grpc.StatusCode.DATA_LOSS and "ChecksumError" in details
        assert (_info(stub).pending_weight_version, _info(stub).policy_version) == (0, current)
        code, _ = _error(lambda: stub.UpdateWeights(pb.UpdateWeightsRequest(version=version), timeout=60))
        assert code == grpc.StatusCode.DATA_LOSS
    finally:
        publisher.close()
    # The manifest is still in Redis, but no publisher serves its buckets any more.
    code, details = _error(lambda: stub.UpdateWeights(pb.UpdateWeightsRequest(version=version), timeout=60))
    assert code == grpc.StatusCode.UNAVAILABLE, details
    assert _info(stub).policy_version == current
    _, samples = _generate(stub, max_tokens=4)
    assert [(s.version, s.start, s.end) for s in samples[0]["final"].version_spans] == [(current, 0, 4)]


def test_deadline_exceeded_aborts_the_engine_request(server):
    stub = server.stub
    long = pb.GenerateRequest(prompt_token_ids=PROMPT, sampling=pb.SamplingParams(max_tokens=240, ignore_eos=True))
    stub.Pause(pb.PauseRequest(mode=pb.PAUSE_MODE_KEEP), timeout=30)  # so the request cannot finish in time
    try:
        code, _ = _error(lambda: list(stub.Generate(long, timeout=1.0)))
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = time.monotonic() + 30
        while (_info(stub).num_engine_requests, _info(stub).num_running) != (0, 0):
            assert time.monotonic() < deadline, "the timed-out request is still held by the engine"
            time.sleep(0.1)
    finally:
        stub.Resume(pb.ResumeRequest(), timeout=30)


def test_metrics_endpoint_reports_throughput_ttft_rejections_and_version(server):
    stub = server.stub
    _generate(stub)
    bad = pb.GenerateRequest(prompt_token_ids=[], sampling=pb.SamplingParams(max_tokens=4))
    assert _error(lambda: list(stub.Generate(bad, timeout=10)))[0] == grpc.StatusCode.INVALID_ARGUMENT
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
    assert values[("rollout_policy_version", ())] == _info(stub).policy_version
    for name in (
        "rollout_requests_running",
        "rollout_requests_waiting",
        "rollout_kv_cache_usage_ratio",
        "rollout_weight_update_s_count",
        "rollout_weight_update_pause_s_count",
    ):
        assert (name, ()) in values, name


def _hf_model_with(model_dir: str, weights: dict[str, torch.Tensor], directory) -> torch.nn.Module:
    """HF transformers' model of ``model_dir`` with checkpoint-format ``weights`` loaded instead."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    shutil.copy(os.path.join(model_dir, "config.json"), directory / "config.json")
    save_file({name: tensor.contiguous() for name, tensor in weights.items()}, str(directory / "model.safetensors"))
    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()


def _hf_token_logprobs(model, prompt, tokens) -> list[float]:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float(), dim=-1)
    return logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def test_mxfp8_weight_update_is_dequantized_into_the_engine_and_matches_hf(server, model_dir, redis_server, tmp_path):
    from weight_bus.codecs.mxfp8 import dequantize, quantize
    from weight_bus.packing import WireCodec

    stub = server.stub
    version = _info(stub).policy_version + 1
    backend = TorchBackend(model_dir, TrainerConfig())
    _perturb(backend, seed=4)
    weights = [(name, tensor.clone()) for name, tensor in backend.export_hf_weights()]
    codec = WireCodec("mxfp8")
    assert sum(codec.quantizes(name, tensor) for name, tensor in weights) > 40
    # The reference: HF transformers with every MXFP8-eligible weight replaced by dequantize(quantize(w)).
    reference = _hf_model_with(
        model_dir,
        {
            name: dequantize(*quantize(tensor), tensor.dtype) if codec.quantizes(name, tensor) else tensor
            for name, tensor in weights
        },
        tmp_path,
    )
    expected = _hf_greedy(reference, PROMPT, 8)
    publisher = WeightPublisher(
        redis.Redis.from_url(redis_server.url), RedisKeys(RUN_ID), WeightBusConfig(codec="mxfp8")
    )
    try:
        publisher.publish(version, weights)
        assert publisher.last_stats.num_tensors > len(weights)  # (q, scale) pairs went on the wire
        assert stub.UpdateWeights(pb.UpdateWeightsRequest(version=version), timeout=60).policy_version == version
    finally:
        publisher.close()
    _, samples = _generate(stub, max_tokens=8, logprobs=0)
    assert samples[0]["tokens"] == expected
    # The engine holds the dequantized weights, not the bf16/fp32 originals: its logprobs match the reference.
    engine_lp = samples[0]["logprobs"]
    reference_lp = _hf_token_logprobs(reference, PROMPT, expected)
    original_lp = _hf_token_logprobs(backend.model, PROMPT, expected)
    off_reference = max(abs(a - b) for a, b in zip(engine_lp, reference_lp, strict=False))
    off_original = max(abs(a - b) for a, b in zip(engine_lp, original_lp, strict=False))
    assert off_reference < 1e-3 and off_reference < off_original / 10, (off_reference, off_original)


def _publish_and_update(stub, redis_server, version: int, weights) -> None:
    publisher = WeightPublisher(redis.Redis.from_url(redis_server.url), RedisKeys(RUN_ID), WeightBusConfig())
    try:
        publisher.publish(version, weights)
        assert stub.UpdateWeights(pb.UpdateWeightsRequest(version=version), timeout=60).policy_version == version
    finally:
        publisher.close()


def test_an_ipc_version_this_engine_cannot_open_arrives_over_tcp(server, model_dir, redis_server):
    """transport 'ipc' announces device buckets by CUDA IPC handles; an engine that cannot open them (here: no GPU)
    takes the same version over tcp, whole, instead of failing the update."""
    from protos.records import CudaIpcBucket, CudaIpcVersion, encode
    from weight_bus.sender import WeightSender

    stub = server.stub
    version = _info(stub).policy_version + 1
    backend = TorchBackend(model_dir, TrainerConfig())
    _perturb(backend, seed=7)
    expected = _hf_greedy(backend.model, PROMPT, 8)
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
    _, samples = _generate(stub, max_tokens=8)
    assert samples[0]["tokens"] == expected
    info = _info(stub)
    assert info.last_weight_source == "publisher" and info.last_weight_update_s > 0  # tcp, not the IPC handles


@pytest.mark.parametrize("target_modules", [["linear_qkv", "linear_fc2"], ["linear_proj", "linear_fc1"]])
def test_lora_update_of_the_adapted_layers_only_matches_the_merged_model(
    server, model_dir, redis_server, target_modules
):
    """A LoRA trainer publishes only the adapted layers; the engine keeps the rest and equals HF's merged model."""
    stub = server.stub
    version = _info(stub).policy_version + 1
    full = list(TorchBackend(model_dir, TrainerConfig()).export_hf_weights())
    _publish_and_update(stub, redis_server, version, full)
    base_tokens = _generate(stub, max_tokens=8)[1][0]["tokens"]
    backend = TorchBackend(model_dir, TrainerConfig(lora=LoraConfig(rank=4, alpha=8, target_modules=target_modules)))
    torch.manual_seed(7)
    with torch.no_grad():  # adapters as if trained: B away from zero
        for param in backend.trainable:
            param.add_(torch.randn_like(param) * 0.5)
    weights = list(backend.export_hf_weights())
    assert 0 < len(weights) < len(full)
    expected = _hf_greedy(backend.model, PROMPT, 8)
    assert expected != base_tokens
    _publish_and_update(stub, redis_server, version + 1, weights)
    _, samples = _generate(stub, max_tokens=8, logprobs=0)
    assert samples[0]["tokens"] == expected
    off = max(
        abs(a - b)
        for a, b in zip(samples[0]["logprobs"], _hf_token_logprobs(backend.model, PROMPT, expected), strict=False)
    )
    assert off < 1e-3, off


# Keep this test last: it stops the module's server.
def test_sigterm_refuses_new_calls_finishes_in_flight_ones_then_exits(server):
    stub = server.stub
    in_flight = stub.Generate(
        # 4 x 200 tokens: long enough to be still running when the signal lands, also on a loaded machine
        pb.GenerateRequest(
            prompt_token_ids=PROMPT, sampling=pb.SamplingParams(n=4, temperature=1.0, max_tokens=200, ignore_eos=True)
        ),
        timeout=120,
    )
    chunks = [next(in_flight)]  # admitted and streaming
    os.kill(server.process.pid, signal.SIGTERM)  # as an orchestrator does: the server, not its engine children
    deadline = time.monotonic() + 20
    while True:  # a call that raced the signal may still be admitted; the next ones are refused
        try:
            list(
                stub.Generate(
                    pb.GenerateRequest(prompt_token_ids=PROMPT, sampling=pb.SamplingParams(max_tokens=2)), timeout=10
                )
            )
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
            break
        assert time.monotonic() < deadline, "new calls still admitted after SIGTERM"
        time.sleep(0.05)
    chunks += list(in_flight)
    finals = [c for c in chunks if c.finished]
    assert len(finals) == 4 and all(c.finish_reason == pb.FINISH_REASON_LENGTH for c in finals)
    assert sum(len(c.token_ids) for c in chunks) == 800
    assert server.process.wait(timeout=GRACE_S + 60) == 0
    assert "draining" in open(server.log_path).read()
