"""SyntheticEngine in process: the GenerationEngine protocol, seeded tokens, chunking, pace, versions across commits,
operator pauses, aborts and routes; and that its path imports no vLLM."""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import sys
import time

import numpy as np
import pytest
from pydantic import ValidationError

from protos.config import RolloutConfig
from rollout_service.engine import RolloutEngine, SamplingRequest
from rollout_service.engine_protocol import GenerationEngine
from rollout_service.synthetic_engine import SyntheticEngine

pytestmark = pytest.mark.unit

PROMPT = [1, 4, 5, 6]


def request(max_tokens: int = 8, n: int = 1, **fields) -> SamplingRequest:
    values = {
        "prompt_token_ids": PROMPT,
        "n": n,
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "stop_token_ids": [],
        "seed": None,
        "logprobs": 0,
        "ignore_eos": False,
        **fields,
    }
    return SamplingRequest(**values)


def engine(seed: int = 0, **synthetic) -> SyntheticEngine:
    config = RolloutConfig(engine="synthetic", seed=seed, synthetic={"tokens_per_s": 0.0, **synthetic})
    return SyntheticEngine("", config, server_id="standin-test")


async def collect(engine_: SyntheticEngine, sampling: SamplingRequest) -> list:
    return [chunk async for chunk in engine_.generate(sampling)]


def samples_of(chunks: list) -> dict[int, dict]:
    samples: dict[int, dict] = {}
    for chunk in chunks:
        sample = samples.setdefault(chunk.sample_index, {"tokens": [], "logprobs": [], "final": None})
        sample["tokens"] += chunk.token_ids
        sample["logprobs"] += chunk.logprobs
        if chunk.finished:
            assert sample["final"] is None, "a sample finished twice"
            sample["final"] = chunk
    return samples


def test_both_engines_keep_to_the_generation_engine_protocol():
    members = [name for name in dir(GenerationEngine) if not name.startswith("_")]
    attributes = list(GenerationEngine.__annotations__)
    assert {"generate", "commit_weights", "errored", "policy_version", "loads_weight_bytes"} <= {*members, *attributes}
    vllm_engine = RolloutEngine("unused", RolloutConfig(), server_id="x")  # start() is never called
    for instance in (vllm_engine, engine()):
        for name in attributes:
            assert hasattr(instance, name), f"{type(instance).__name__} has no attribute {name}"
        for name in members:
            expected = inspect.getattr_static(GenerationEngine, name)
            actual = inspect.getattr_static(type(instance), name)
            if isinstance(expected, property):
                assert isinstance(actual, property), f"{type(instance).__name__}.{name} must be a property"
                continue
            assert inspect.signature(actual).parameters.keys() == inspect.signature(expected).parameters.keys(), name
            same_kind = inspect.iscoroutinefunction(actual) == inspect.iscoroutinefunction(expected)
            assert same_kind or inspect.isasyncgenfunction(actual), f"{type(instance).__name__}.{name}: async or not"
    assert vllm_engine.loads_weight_bytes and not engine().loads_weight_bytes


def test_the_same_request_gets_the_same_tokens_and_seeds_change_them():
    first = samples_of(asyncio.run(collect(engine(), request(16, n=3))))
    again = samples_of(asyncio.run(collect(engine(), request(16, n=3))))
    assert [first[i]["tokens"] for i in range(3)] == [again[i]["tokens"] for i in range(3)]
    assert first[0]["logprobs"] == again[0]["logprobs"]
    assert first[0]["tokens"] != first[1]["tokens"], "samples of one request must differ"
    other_engine_seed = samples_of(asyncio.run(collect(engine(seed=1), request(16))))
    other_request_seed = samples_of(asyncio.run(collect(engine(), request(16, seed=7))))
    assert other_engine_seed[0]["tokens"] != first[0]["tokens"]
    assert other_request_seed[0]["tokens"] != first[0]["tokens"]
    tokens = np.array([first[i]["tokens"] for i in range(3)])
    assert tokens.min() >= 0 and tokens.max() < 64
    assert all(lp <= 0.0 for lp in first[0]["logprobs"])


def test_chunks_are_one_token_then_the_stream_interval_and_the_last_carries_the_finish():
    chunks = asyncio.run(collect(engine(), request(20, stream_interval=8)))
    assert [len(chunk.token_ids) for chunk in chunks] == [1, 8, 8, 3]
    assert [chunk.finished for chunk in chunks] == [False, False, False, True]
    assert chunks[-1].finish_reason == "length"
    assert chunks[-1].version_spans == [(0, 0, 20)]
    assert chunks[-1].routed_experts is None


def test_a_drawn_stop_token_ends_the_sample_with_stop():
    plain = samples_of(asyncio.run(collect(engine(), request(32))))[0]["tokens"]
    stop_id = plain[5]
    stopped = samples_of(asyncio.run(collect(engine(), request(32, stop_token_ids=[stop_id]))))[0]
    end = plain.index(stop_id) + 1
    assert stopped["tokens"] == plain[:end]
    assert stopped["final"].finish_reason == "stop"
    assert stopped["final"].version_spans == [(0, 0, end)]


def test_tokens_come_at_the_sample_rate_and_within_the_server_cap():
    paced = engine(tokens_per_s=400.0)
    started = time.monotonic()
    asyncio.run(collect(paced, request(40, n=2)))
    assert time.monotonic() - started >= 0.095  # 40 tokens at 400/s, both samples side by side

    capped = engine(server_tokens_per_s=2000.0)

    async def two_requests():
        await asyncio.gather(collect(capped, request(50, n=2)), collect(capped, request(50, n=2, seed=3)))

    started = time.monotonic()
    asyncio.run(two_requests())
    assert time.monotonic() - started >= 0.095  # 200 tokens within 2000/s for the whole server


def test_tokens_after_a_commit_carry_the_new_version():
    async def scenario():
        stand_in = engine(tokens_per_s=200.0)
        stream = stand_in.generate(request(12, n=2, stream_interval=4))
        chunks = [await anext(stream)]  # the first token of sample 0 (v0)
        chunks.append(await anext(stream))  # ... and of sample 1
        paused_s = await stand_in.commit_weights(3, "", b"")
        chunks += [chunk async for chunk in stream]
        return stand_in, paused_s, chunks

    stand_in, paused_s, chunks = asyncio.run(scenario())
    assert stand_in.policy_version == 3 and paused_s >= 0.0
    finals = [chunk for chunk in chunks if chunk.finished]
    assert [final.version_spans for final in finals] == [[(0, 0, 1), (3, 1, 12)]] * 2


def test_an_operator_pause_holds_generation_across_a_commit_until_resume():
    async def scenario():
        stand_in = engine(tokens_per_s=1000.0)
        stream = stand_in.generate(request(6, stream_interval=2))
        await anext(stream)
        await stand_in.pause("keep")
        await stand_in.commit_weights(1, "", b"")  # must not resume the operator's pause
        held = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.05)  # kept: that no chunk comes out (25 chunk intervals here) needs time to pass
        was_held = not held.done()
        await stand_in.resume()
        rest = [await held] + [chunk async for chunk in stream]
        return was_held, rest

    was_held, rest = asyncio.run(scenario())
    assert was_held, "a chunk came out while the operator's pause held"
    assert rest[-1].finished and rest[-1].version_spans == [(0, 0, 1), (1, 1, 6)]


def test_an_abort_ends_unfinished_samples_with_abort():
    async def scenario():
        stand_in = engine(tokens_per_s=100.0)
        stream = stand_in.generate(request(50, n=2, request_id="r1"))
        first = [await anext(stream), await anext(stream)]
        await stand_in.abort(["r1"])
        rest = [chunk async for chunk in stream]
        return stand_in, first + rest

    stand_in, chunks = asyncio.run(scenario())
    finals = [chunk for chunk in chunks if chunk.finished]
    assert sorted(final.sample_index for final in finals) == [0, 1]
    assert {final.finish_reason for final in finals} == {"abort"}
    assert stand_in.num_unfinished() == 0


def test_routes_have_the_configured_shape_and_distinct_experts():
    stand_in = engine(moe_layers=3, moe_top_k=2, moe_num_experts=8)
    assert stand_in.routed_experts_available
    final = samples_of(asyncio.run(collect(stand_in, request(10))))[0]["final"]
    routes = final.routed_experts
    assert routes.shape == (len(PROMPT) + 10 - 1, 3, 2) and routes.dtype == np.int32
    assert routes.min() >= 0 and routes.max() < 8
    assert (routes[..., 0] != routes[..., 1]).all()


def test_routes_wider_than_the_experts_are_refused_naming_the_field():
    with pytest.raises(ValidationError, match="rollout.synthetic.moe_top_k"):
        RolloutConfig(synthetic={"moe_layers": 2, "moe_top_k": 9, "moe_num_experts": 8})


def test_the_synthetic_path_imports_no_vllm():
    code = (
        "import sys\n"
        "import rollout_service.standin_fleet, rollout_service.synthetic_engine, rollout_service.server\n"
        "import rollout_service.weight_sync\n"
        "loaded = [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_top_logprobs_are_refused_naming_the_field_the_synthetic_engine_has_none():
    from rollout_service.engine import RequestRejected

    with pytest.raises(RequestRejected, match=r"sampling.logprobs: the synthetic engine has no top logprobs"):
        asyncio.run(collect(engine(), request(logprobs=2)))
