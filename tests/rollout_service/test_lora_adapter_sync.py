"""Adapter-only weight sync into vLLM's LoRA slot, on the CPU engine, against merged weights.

Per dense tiny model (Qwen3, and Beam with every layer dense: vLLM on CPU serves LoRA only without MoE layers, see
rollout_service/lora_slot.py), two real rollout server processes: one serving the frozen base with a LoRA slot
(``rollout.lora``) that takes the trainer's adapters over the weight bus, one taking the same policy's merged
weights as full weights (``trainer.lora.sync='merged'``). The same prompts, greedy: equal tokens, log-probs within
2e-4 (the slot computes ``W x + s B (A x)``, the merged path ``(W + s B A) x``: fp32 rounding apart). The expert
part runs on a GPU engine only (scripts/gpu_check_sections.py, ``lora_adapter_sync``).
"""

from __future__ import annotations

import threading

import pytest
import redis
import torch

from protos import rollout_pb2 as pb
from protos.config import LoraConfig, TrainerConfig, WeightBusConfig
from protos.redis_keys import RedisKeys
from tests.rollout_service.lora_models import (
    DENSE_MODELS,
    adapter_trainer,
    make_dense_model,
    server_overrides,
    set_random_adapters,
)
from tests.rollout_service.server_calls import (
    PROMPT,
    ServerSpec,
    generate,
    hf_greedy,
    rpc_error,
    running_servers,
    server_info,
)
from tests.waiting import wait_until
from trainer_service.publisher import WeightPublisher
from trainer_service.torch_backend import TorchBackend

pytestmark = pytest.mark.integration

PROMPTS = [PROMPT, [1, 9, 3, 7, 12, 4]]
LOGPROB_TOLERANCE = 2e-4
ADAPTER_RUN, MERGED_RUN = "lora-adapters", "lora-merged"


@pytest.fixture(scope="module", params=DENSE_MODELS)
def model_dir(request, tmp_path_factory):
    return make_dense_model(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def servers(model_dir, redis_server, tmp_path_factory):
    """(adapter server, merged-weights server), both from the same base checkpoint."""
    lora = ServerSpec(tmp_path_factory.mktemp("lora-logs"), tuple(server_overrides()), ADAPTER_RUN)
    merged = ServerSpec(tmp_path_factory.mktemp("merged-logs"), (), MERGED_RUN)
    with running_servers(model_dir, redis_server.url, lora, merged) as (lora_server, merged_server):
        yield lora_server, merged_server


@pytest.fixture(scope="module")
def publishers(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    adapters = WeightPublisher(client, RedisKeys(ADAPTER_RUN), WeightBusConfig())
    merged = WeightPublisher(client, RedisKeys(MERGED_RUN), WeightBusConfig())
    yield adapters, merged
    adapters.close()
    merged.close()


def publish_policy(backend: TorchBackend, version: int, publishers, servers) -> None:
    """The same policy as ``version`` to both servers: adapters to one, merged weights to the other."""
    adapter_publisher, merged_publisher = publishers
    adapter_publisher.publish(version, backend.export_adapter_weights(), backend.adapter_record())
    merged_publisher.publish(version, backend.export_hf_weights())
    for server in servers:
        reply = server.stub.UpdateWeights(pb.UpdateWeightsRequest(version=version), timeout=120)
        assert reply.policy_version == version


def assert_same_generations(servers, version: int) -> None:
    lora_server, merged_server = servers
    for prompt in PROMPTS:
        _, lora = generate(lora_server.stub, prompt, max_tokens=12, logprobs=0)
        _, merged = generate(merged_server.stub, prompt, max_tokens=12, logprobs=0)
        assert lora[0]["tokens"] == merged[0]["tokens"], prompt
        differences = [abs(a - b) for a, b in zip(lora[0]["logprobs"], merged[0]["logprobs"], strict=True)]
        assert max(differences) < LOGPROB_TOLERANCE, (prompt, differences)
        spans = [(s.version, s.start, s.end) for s in lora[0]["final"].version_spans]
        assert spans == [(version, 0, 12)]


def test_adapter_versions_serve_as_the_merged_weights_do(model_dir, servers, publishers):
    lora_server, merged_server = servers
    base = generate(lora_server.stub, PROMPT, max_tokens=12)[1][0]["tokens"]
    assert base == generate(merged_server.stub, PROMPT, max_tokens=12)[1][0]["tokens"]  # v0: the zero adapter
    backend = adapter_trainer(model_dir)
    set_random_adapters(backend, seed=1)
    publish_policy(backend, 1, publishers, servers)
    assert_same_generations(servers, 1)
    assert generate(lora_server.stub, PROMPT, max_tokens=12)[1][0]["tokens"] != base  # the adapter is in force

    set_random_adapters(backend, seed=2)  # the next version replaces the adapter in place
    publish_policy(backend, 2, publishers, servers)
    assert_same_generations(servers, 2)
    assert hf_greedy(backend.model, PROMPT, 12) == generate(lora_server.stub, PROMPT, max_tokens=12)[1][0]["tokens"]


def test_a_request_in_flight_continues_on_the_new_adapter_from_the_commit_on(model_dir, servers, publishers):
    lora_server, _ = servers
    version = server_info(lora_server.stub).policy_version + 1
    backend = adapter_trainer(model_dir)
    set_random_adapters(backend, seed=3)
    length = 200
    tokens, final = [], []

    def stream() -> None:
        request = pb.GenerateRequest(
            prompt_token_ids=PROMPT,
            sampling=pb.SamplingParams(max_tokens=length, temperature=0.0, ignore_eos=True, stream_interval=1),
        )
        for chunk in lora_server.stub.Generate(request, timeout=120):
            tokens.extend(chunk.token_ids)
            final.extend([chunk] if chunk.finished else [])

    reader = threading.Thread(target=stream)
    reader.start()
    wait_until(lambda: tokens, "the request generating on the current adapter", 60, poll_s=0.005)
    adapter_publisher, _ = publishers
    adapter_publisher.publish(version, backend.export_adapter_weights(), backend.adapter_record())
    reply = lora_server.stub.UpdateWeights(pb.UpdateWeightsRequest(version=version), timeout=120)
    assert reply.policy_version == version
    reader.join(timeout=120)
    spans = [(s.version, s.start, s.end) for s in final[0].version_spans]
    if len(spans) == 1:
        pytest.skip(f"the request finished before the commit ({spans}); nothing crossed it")
    (old, start, switch), (new, switch_again, end) = spans
    assert (start, new, switch_again, end) == (0, version, switch, length) and old < version
    # Greedy from the commit on: each later token is the new policy's argmax after the tokens before it (teacher
    # forced: HF's own generate would refuse EOS, which ignore_eos lets the engine sample).
    assert tokens[switch:] == greedy_choices(backend.model, PROMPT, tokens)[switch:]


def greedy_choices(model, prompt: list[int], tokens: list[int]) -> list[int]:
    """The argmax token ``model`` puts at each response position, given the prompt and the tokens before it."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    return logits.argmax(dim=-1).tolist()


def test_a_lora_server_refuses_full_weights_and_stays_on_its_version(model_dir, servers, redis_server):
    lora_server, _ = servers
    before = server_info(lora_server.stub).policy_version
    backend = TorchBackend(model_dir, TrainerConfig(geo_mask=None, lora=LoraConfig(rank=8, alpha=16.0)))
    publisher = WeightPublisher(redis.Redis.from_url(redis_server.url), RedisKeys(ADAPTER_RUN), WeightBusConfig())
    try:
        publisher.publish(before + 1, backend.export_hf_weights())  # merged layers, not an adapter
        code, details = rpc_error(
            lambda: lora_server.stub.UpdateWeights(pb.UpdateWeightsRequest(version=before + 1), timeout=60)
        )
    finally:
        publisher.close()
    assert "trainer.lora.sync='adapters'" in details, (code, details)
    assert server_info(lora_server.stub).policy_version == before
