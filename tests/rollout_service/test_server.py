"""The rollout server as a real process: vLLM CPU engine, gRPC on loopback, weights over the bus."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import grpc
import pytest
import redis
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from coordinator.redis_server import free_port
from modeling.tiny_model import init_tiny
from protos import rollout_pb2 as pb
from protos import rollout_pb2_grpc as pb_grpc
from protos.config import TrainerConfig, WeightBusConfig
from protos.redis_keys import RedisKeys
from trainer_service.publisher import WeightPublisher
from trainer_service.torch_backend import TorchBackend

PROMPT = [1, 4, 5, 6]
RUN_ID = "rollout-test"
MAX_INFLIGHT = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(init_tiny(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def server(model_dir, redis_server, tmp_path_factory):
    """One rollout server process for the whole module (engine start is the slow part)."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("logs") / "rollout.log", "wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "rollout_service", "serve", "--model", model_dir, "--port", str(port),
         "--server-id", "test-0", "--redis-url", redis_server.url, "--run-id", RUN_ID,
         f"rollout.max_inflight_requests={MAX_INFLIGHT}"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + 240
    while True:
        assert process.poll() is None, open(log.name).read()[-3000:]
        try:
            if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                break
        except grpc.RpcError:
            pass
        assert time.monotonic() < deadline, "rollout server did not become healthy in 240 s"
        time.sleep(0.5)
    yield channel, pb_grpc.RolloutServiceStub(channel)
    channel.close()
    os.killpg(process.pid, 15)
    process.wait(timeout=30)


def _generate(stub, prompt=PROMPT, **sampling):
    params = {"n": 1, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True, **sampling}
    chunks = list(stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(**params)), timeout=60))
    samples: dict[int, dict] = {}
    for chunk in chunks:
        sample = samples.setdefault(chunk.sample_index, {"tokens": [], "logprobs": [], "final": None})
        sample["tokens"] += list(chunk.token_ids)
        sample["logprobs"] += list(chunk.logprobs)
        if chunk.finished:
            sample["final"] = chunk
    return chunks, samples


def test_generate_streams_tokens_logprobs_and_version_spans(server):
    _, stub = server
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


def test_health_reflection_and_server_info(server):
    channel, stub = server
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
    ({"sampling": {"max_tokens": 4, "top_p": 1.5}}, "top_p"),
    ({"sampling": {"max_tokens": 4, "top_p": -0.1}}, "top_p"),
    ({"sampling": {"max_tokens": 4, "min_p": 2.0}}, "min_p"),
    ({"sampling": {"max_tokens": 4, "top_k": -7}}, "top_k"),
    ({"sampling": {"max_tokens": 4, "logprobs": 1000}}, "logprobs"),
    ({"sampling": {"max_tokens": 4, "stop_token_ids": [70000]}}, "stop_token_ids"),
    ({"request_id": "x" * 1000, "sampling": {"max_tokens": 4}}, "request_id"),
]


def test_malformed_requests_get_invalid_argument_and_server_keeps_serving(server):
    _, stub = server
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
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=num_tokens, min_new_tokens=num_tokens, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_weight_update_makes_engine_greedy_output_equal_the_trainers(server, model_dir, redis_server):
    _, stub = server
    backend = TorchBackend(model_dir, TrainerConfig())
    before = _generate(stub, max_tokens=8)[1][0]["tokens"]
    assert before == _hf_greedy(backend.model, PROMPT, 8)
    torch.manual_seed(1)
    with torch.no_grad():  # a large random step, as if trained, that changes the greedy output
        for param in backend.model.parameters():
            param.add_(torch.randn_like(param) * param.std().clamp(min=0.05))
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
    _, stub = server
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
