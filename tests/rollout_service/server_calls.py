"""Helpers of the rollout server tests (test_server.py, test_server_weight_updates.py): the server process, its
calls, and the HF references a weight update is checked against."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import redis
import torch

from launcher.redis_server import free_port
from protos import rollout_pb2 as pb
from protos import rollout_pb2_grpc as pb_grpc
from protos.config import WeightBusConfig
from protos.redis_keys import RedisKeys
from tests.rollout_service.server_process import ServerProcess, spawn_rollout_server
from trainer_service.publisher import WeightPublisher
from trainer_service.torch_backend import TorchBackend

PROMPT = [1, 4, 5, 6]
RUN_ID = "rollout-test"
MAX_INFLIGHT = 4
GRACE_S = 20.0


@dataclass
class ServerHandle:
    channel: grpc.Channel
    stub: pb_grpc.RolloutServiceStub
    process: subprocess.Popen
    metrics_port: int
    log_path: str


@dataclass(frozen=True)
class ServerSpec:
    """One rollout server of :func:`running_servers`: its log folder, more config overrides and its run."""

    logs: Path
    overrides: tuple[str, ...] = ()
    run_id: str = RUN_ID


@contextlib.contextmanager
def running_server(
    model_dir: str, redis_url: str, logs: Path, *overrides: str, run_id: str = RUN_ID
) -> Iterator[ServerHandle]:
    """One rollout server process (weight_updates=manual) for a test module; stopped on exit unless a test did.
    ``overrides``: more dotted config overrides (``rollout.lora.enabled=true``)."""
    with running_servers(model_dir, redis_url, ServerSpec(logs, overrides, run_id)) as (handle,):
        yield handle


@contextlib.contextmanager
def running_servers(model_dir: str, redis_url: str, *specs: ServerSpec) -> Iterator[list[ServerHandle]]:
    """Rollout server processes as :func:`running_server` starts one, all spawned before any is waited for (their
    engines start side by side instead of one after the other; with several, each engine on its own core as the
    launcher places its servers); every one is stopped on exit."""
    started: list[tuple[ServerProcess, int]] = []
    handles: list[ServerHandle] = []
    try:
        for index, spec in enumerate(specs):
            cores = {"VLLM_CPU_OMP_THREADS_BIND": str(index % (os.cpu_count() or 1))} if len(specs) > 1 else {}
            metrics_port = free_port()
            # manual: weights change only through the gRPC calls the tests make, never on an announcement
            spawned = spawn_rollout_server(
                model_dir,
                spec.logs / "rollout.log",
                "--server-id",
                "test-0",
                "--redis-url",
                redis_url,
                "--run-id",
                spec.run_id,
                "--metrics-port",
                str(metrics_port),
                "--grace-s",
                str(GRACE_S),
                f"rollout.max_inflight_requests={MAX_INFLIGHT}",
                "rollout.weight_updates=manual",
                *spec.overrides,
                env=cores,
            )
            started.append((spawned, metrics_port))
        for spawned, metrics_port in started:
            channel = grpc.insecure_channel(spawned.wait_serving(timeout_s=240).address)
            stub = pb_grpc.RolloutServiceStub(channel)
            handles.append(ServerHandle(channel, stub, spawned.process, metrics_port, str(spawned.log_path)))
        yield handles
    finally:
        for handle in handles:
            handle.channel.close()
        for spawned, _ in started:
            if spawned.process.poll() is None:  # the shutdown test normally stops it
                os.killpg(spawned.process.pid, 15)
                spawned.process.wait(timeout=60)


def generate(stub, prompt=PROMPT, **sampling):
    params = {"n": 1, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True, **sampling}
    chunks = list(
        stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(**params)), timeout=60)
    )
    samples: dict[int, dict] = {}
    for chunk in chunks:
        sample = samples.setdefault(
            chunk.sample_index, {"tokens": [], "logprobs": [], "top_ids": [], "top_logprobs": [], "final": None}
        )
        sample["tokens"] += list(chunk.token_ids)
        sample["logprobs"] += list(chunk.logprobs)
        sample["top_ids"] += list(chunk.top_token_ids)
        sample["top_logprobs"] += list(chunk.top_logprobs)
        if chunk.finished:
            sample["final"] = chunk
    return chunks, samples


def hf_greedy(model, prompt, num_tokens):
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


def perturb(backend: TorchBackend, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():  # a large random step, as if trained, that changes the greedy output
        for param in backend.model.parameters():
            param.add_(torch.randn_like(param) * param.std().clamp(min=0.05))


def rpc_error(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value.code(), caught.value.details()


def server_info(stub) -> pb.ServerInfoResponse:
    return stub.ServerInfo(pb.ServerInfoRequest(), timeout=10)


def hf_model_with(model_dir: str, weights: dict[str, torch.Tensor], directory) -> torch.nn.Module:
    """HF transformers' model of ``model_dir`` with checkpoint-format ``weights`` loaded instead."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    shutil.copy(os.path.join(model_dir, "config.json"), directory / "config.json")
    save_file({name: tensor.contiguous() for name, tensor in weights.items()}, str(directory / "model.safetensors"))
    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()


def hf_token_logprobs(model, prompt, tokens) -> list[float]:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float(), dim=-1)
    return logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def publish_and_update(stub, redis_server, version: int, weights) -> None:
    """Publish ``weights`` as ``version`` over tcp and have the server take it (UpdateWeights)."""
    publisher = WeightPublisher(redis.Redis.from_url(redis_server.url), RedisKeys(RUN_ID), WeightBusConfig())
    try:
        publisher.publish(version, weights)
        assert stub.UpdateWeights(pb.UpdateWeightsRequest(version=version), timeout=60).policy_version == version
    finally:
        publisher.close()
