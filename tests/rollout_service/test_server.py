"""The rollout server as a real process: vLLM CPU engine, gRPC on loopback; serving, limits, shutdown.

Weight updates over the bus are test_server_weight_updates.py (a server of its own).
"""

from __future__ import annotations

import os
import signal
import time
from datetime import datetime

import grpc
import pytest
import torch
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from modeling.tiny_model import init_tiny
from protos import rollout_pb2 as pb
from tests.rollout_service.server_calls import (
    GRACE_S,
    MAX_INFLIGHT,
    PROMPT,
    generate,
    rpc_error,
    running_server,
    server_info,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(init_tiny(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def server(model_dir, redis_server, tmp_path_factory):
    """One rollout server process for the whole module (engine start is the slow part)."""
    with running_server(model_dir, redis_server.url, tmp_path_factory.mktemp("logs")) as handle:
        yield handle


def test_generate_streams_tokens_logprobs_and_version_spans(server):
    stub = server.stub
    chunks, samples = generate(stub, n=3, temperature=1.0, max_tokens=6)
    assert len(chunks) > 3  # streamed in pieces, not one message per sample
    assert sorted(samples) == [0, 1, 2]
    for sample in samples.values():
        assert len(sample["tokens"]) == 6 and len(sample["logprobs"]) == 6
        assert all(lp <= 0.0 for lp in sample["logprobs"])
        final = sample["final"]
        assert final.finish_reason == pb.FINISH_REASON_LENGTH
        assert [(s.version, s.start, s.end) for s in final.version_spans] == [(0, 0, 6)]
        assert not final.HasField("routed_experts")  # vLLM on CPU cannot return routes


def test_top_logprobs_asked_for_are_each_tokens_most_likely_tokens_by_rank(server, model_dir):
    """sampling.logprobs = k: every new token comes with the k most likely tokens of the distribution it was sampled
    from (at the request's temperature), by rank, as the reference model computes them."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    chunks, samples = generate(server.stub, n=1, temperature=0.5, max_tokens=5, logprobs=3)
    sample = samples[0]
    assert len(sample["top_ids"]) == len(sample["top_logprobs"]) == 3 * 5  # [tokens, k], row-major
    assert all(len(c.top_token_ids) == 3 * len(c.token_ids) for c in chunks)  # each chunk carries its tokens' rows
    ids = torch.tensor([PROMPT + sample["tokens"]])
    with torch.no_grad():
        logits = reference(input_ids=ids).logits[0, len(PROMPT) - 1 : -1].float()
    expected = torch.log_softmax(logits / 0.5, dim=-1).topk(3, dim=-1)
    served_ids = torch.tensor(sample["top_ids"]).view(5, 3)
    served = torch.tensor(sample["top_logprobs"]).view(5, 3)
    assert torch.equal(served_ids, expected.indices), (served_ids, expected.indices)
    assert (served - expected.values).abs().max() < 1e-3
    assert (served[:, :-1] >= served[:, 1:]).all()  # by rank
    _, plain = generate(server.stub, n=1, max_tokens=2)
    assert plain[0]["top_ids"] == [] and plain[0]["top_logprobs"] == []  # none asked, none sent


def test_logprobs_are_of_the_distribution_the_tokens_were_sampled_from(server, model_dir):
    """At temperature T the sampler draws from softmax(logits / T): the logprobs must be of that distribution
    (vLLM's default returns those of the raw logits), or every off-policy ratio at T != 1 is off."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()  # the weights served now
    _, samples = generate(server.stub, n=2, temperature=0.5, max_tokens=6)
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
    chunks, samples = generate(server.stub, n=2, temperature=1.0, max_tokens=12, stream_interval=4)
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
    _, samples = generate(stub)
    assert len(samples[0]["tokens"]) == 6


def test_requests_beyond_the_inflight_limit_get_resource_exhausted_and_cancel_frees_slots(server):
    stub = server.stub
    long = pb.GenerateRequest(prompt_token_ids=PROMPT, sampling=pb.SamplingParams(max_tokens=240, ignore_eos=True))
    # Paused (keep): admitted requests stay in flight instead of racing to finish.
    stub.Pause(pb.PauseRequest(mode=pb.PAUSE_MODE_KEEP), timeout=30)
    calls = [stub.Generate(long, timeout=120) for _ in range(MAX_INFLIGHT)]
    wait_until(lambda: server_info(stub).num_running >= MAX_INFLIGHT, "every call admitted", 30)
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(long, timeout=30))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "in flight" in caught.value.details()
    for call in calls:
        call.cancel()  # a client that cancels aborts its engine request and frees its slot
    stub.Resume(pb.ResumeRequest(), timeout=30)
    wait_until(lambda: server_info(stub).num_running == 0, "cancelled calls no longer running", 30, poll_s=0.1)
    _, samples = generate(stub)
    assert len(samples[0]["tokens"]) == 6


def test_deadline_exceeded_aborts_the_engine_request(server):
    stub = server.stub
    long = pb.GenerateRequest(prompt_token_ids=PROMPT, sampling=pb.SamplingParams(max_tokens=240, ignore_eos=True))
    stub.Pause(pb.PauseRequest(mode=pb.PAUSE_MODE_KEEP), timeout=30)  # so the request cannot finish in time
    try:
        code, _ = rpc_error(lambda: list(stub.Generate(long, timeout=1.0)))
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_until(
            lambda: (info := server_info(stub)).num_engine_requests == info.num_running == 0,
            "the timed-out request gone from the engine",
            30,
            poll_s=0.1,
        )
    finally:
        stub.Resume(pb.ResumeRequest(), timeout=30)


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

    def refused() -> bool:  # a call that raced the signal may still be admitted; the next ones are refused
        short = pb.GenerateRequest(prompt_token_ids=PROMPT, sampling=pb.SamplingParams(max_tokens=2))
        try:
            list(stub.Generate(short, timeout=10))
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
            return True
        return False

    wait_until(refused, "new calls refused after SIGTERM", 20)
    chunks += list(in_flight)
    finals = [c for c in chunks if c.finished]
    assert len(finals) == 4 and all(c.finish_reason == pb.FINISH_REASON_LENGTH for c in finals)
    assert sum(len(c.token_ids) for c in chunks) == 800
    assert server.process.wait(timeout=GRACE_S + 60) == 0
    exited_s = time.time()
    log = open(server.log_path).read()
    assert "draining" in log
    # It leaves once it has stopped: the interpreter's teardown (9-10 s of garbage collection on a busy machine) is
    # skipped, so a launcher's stop (10 s grace) never has to SIGKILL it.
    stopped = next(line for line in log.splitlines() if line.endswith(" stopped") and "rollout server" in line)
    stopped_s = datetime.strptime(stopped[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    assert exited_s - stopped_s < 2.0, f"exited {exited_s - stopped_s:.1f}s after it stopped"
