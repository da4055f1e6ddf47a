#!/usr/bin/env python
"""Overhead of fleetrl's gRPC rollout server over vLLM AsyncLLM in process, measured side by side.

Run from the repository root on a machine with vLLM (CPU or GPU)::

    .venv/bin/python benchmarks/rollout_overhead.py [--requests 64 --n 8 --max-tokens 128 --rounds 3]

Both sides run the same engine configuration (``RolloutConfig`` defaults) on the same tiny MoE model,
with the same prompts and sampling (temperature 1, ``ignore_eos`` so every sample has exactly
``max_tokens`` tokens, ``stream_interval`` tokens per streamed chunk), all requests submitted at once so
the engine stays busy:

(a) ``inproc``: ``AsyncLLM.generate`` called directly in this process (no fleetrl code on the path);
(b) ``grpc``: ``python -m rollout_service serve`` as its own process, called over loopback gRPC.

Rounds alternate a, b, a, b, ... after one warm-up each (the first generation after start pays a
one-time warm-up), and the medians are compared. The last line printed is one JSON object:
``{"inproc_tok_s": .., "grpc_tok_s": .., "ratio": ..}`` (ratio = grpc / inproc, goal >= 0.97).
It also prints the CPU milliseconds per 1000 tokens of each process group (this process, its engine,
the server process, the server's engine): the profile of where the gRPC path spends more.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64, help="Generate calls per round, all in flight at once")
    parser.add_argument("--n", type=int, default=8, help="samples per call (a GRPO group)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per side")
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=16,
        help="tokens per streamed chunk, per request on both sides (the coordinator asks max_tokens)",
    )
    parser.add_argument("--model", default="", help="checkpoint; default: a random tiny MoE built in a temp dir")
    parser.add_argument(
        "overrides",
        nargs="*",
        help="rollout.* config overrides for both engines (GPU: "
        "rollout.dtype=bfloat16 rollout.gpu_memory_utilization=0.4 ...)",
    )
    return parser.parse_args()


def prompts(args: argparse.Namespace) -> list[list[int]]:
    # Distinct prompts of token ids inside the tiny vocabulary (3..63), no prefix sharing effects.
    return [[1] + [3 + (i * 7 + j * 3) % 60 for j in range(args.prompt_len - 1)] for i in range(args.requests)]


async def inproc_round(engine, args: argparse.Namespace, round_index: int) -> tuple[int, float]:
    """(tokens, seconds) of one round through AsyncLLM.generate directly."""
    from vllm.inputs import TokensPrompt

    from rollout_service.engine import SamplingRequest

    async def one(i: int, prompt: list[int]) -> int:
        request = SamplingRequest(
            prompt, args.n, args.max_tokens, 1.0, 1.0, -1, 0.0, [], None, 0, True, stream_interval=args.stream_interval
        )
        params = engine._sampling_params(request)  # the exact SamplingParams the server builds
        tokens = 0
        async for output in engine.llm.generate(TokensPrompt(prompt_token_ids=prompt), params, f"r{round_index}-{i}"):
            tokens += sum(len(c.token_ids) for c in output.outputs)
        return tokens

    started = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts(args))))
    return sum(counts), time.perf_counter() - started


async def grpc_round(stub, args: argparse.Namespace) -> tuple[int, float]:
    """(tokens, seconds) of one round through the gRPC server."""
    from protos import rollout_pb2 as pb

    sampling = pb.SamplingParams(
        n=args.n, max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True, stream_interval=args.stream_interval
    )

    async def one(prompt: list[int]) -> int:
        tokens = 0
        async for message in stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling), timeout=600):
            tokens += len(message.token_ids)
        return tokens

    started = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts(args)))
    return sum(counts), time.perf_counter() - started


async def start_server(model: str, args: argparse.Namespace, log_path: Path):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from launcher.redis_server import free_port
    from protos import rollout_pb2_grpc as pb_grpc

    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollout_service",
            "serve",
            "--model",
            model,
            "--port",
            str(port),
            f"rollout.max_inflight_requests={max(256, args.requests)}",
            *args.overrides,
        ],
        stdout=open(log_path, "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + 300
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"rollout server exited: {log_path.read_text()[-2000:]}")
        try:
            reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=1)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return process, channel, pb_grpc.RolloutServiceStub(channel), f"127.0.0.1:{port}"
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("rollout server not SERVING after 300 s")
        await asyncio.sleep(0.5)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its children (engine core, worker)."""
    import psutil

    total = 0.0
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def cpu_split(server_pid: int) -> dict[str, float]:
    """CPU seconds so far of: this process alone, its engine children, the server process, its engine."""
    import psutil

    me = psutil.Process()
    own = sum(me.cpu_times()[:2])
    server = psutil.Process(server_pid)
    # The server was started from here, so it is one of our children: count its tree apart.
    return {
        "bench": own,
        "inproc_engine": cpu_seconds(me.pid) - own - cpu_seconds(server_pid),
        "server_frontend": sum(server.cpu_times()[:2]),
        "server_engine": cpu_seconds(server_pid) - sum(server.cpu_times()[:2]),
    }


async def main_async(args: argparse.Namespace) -> dict:
    from modeling.tiny_model import init_tiny
    from rollout_service.engine import RolloutEngine

    workdir = Path(tempfile.mkdtemp(prefix="fleetrl-bench-"))
    model = args.model or str(init_tiny(workdir / "tiny"))
    process, channel, stub, _ = await start_server(model, args, workdir / "server.log")
    from protos.config import load_run_config

    config = load_run_config(None, [*args.overrides, "rollout.max_inflight_requests=1024"]).rollout
    engine = RolloutEngine(model, config)
    await engine.start()
    expected = args.requests * args.n * args.max_tokens
    results: dict[str, list[float]] = {"inproc": [], "grpc": []}
    cpu_ms_per_ktok: dict[str, dict[str, list[float]]] = {"inproc": {}, "grpc": {}}
    try:
        for round_index in range(args.rounds + 1):  # round 0 warms both up and is not counted
            for side in ("inproc", "grpc"):
                cpu_before = cpu_split(process.pid)
                if side == "inproc":
                    tokens, seconds = await inproc_round(engine, args, round_index)
                else:
                    tokens, seconds = await grpc_round(stub, args)
                if tokens != expected:
                    raise RuntimeError(f"{side} round {round_index}: {tokens} tokens, expected {expected}")
                label = "warm-up" if round_index == 0 else f"round {round_index}"
                print(
                    f"{label:8s} {side:6s} {tokens} tokens in {seconds:6.2f} s = {tokens / seconds:9.0f} tok/s",
                    flush=True,
                )
                if round_index:
                    results[side].append(tokens / seconds)
                    cpu_after = cpu_split(process.pid)
                    for part, value in cpu_after.items():
                        used = 1000 * (value - cpu_before[part]) / (tokens / 1000)
                        cpu_ms_per_ktok[side].setdefault(part, []).append(used)
    finally:
        engine.shutdown()
        await channel.close()
        os.killpg(process.pid, 15)
        process.wait(timeout=60)
    inproc, grpc_tok_s = statistics.median(results["inproc"]), statistics.median(results["grpc"])
    print("CPU ms per 1000 tokens (median over rounds; the idle side's figures show background cost):")
    for side, parts in cpu_ms_per_ktok.items():
        print(f"  {side:6s} " + "  ".join(f"{part}={statistics.median(v):6.1f}" for part, v in parts.items()))
    return {
        "inproc_tok_s": round(inproc, 1),
        "grpc_tok_s": round(grpc_tok_s, 1),
        "ratio": round(grpc_tok_s / inproc, 4),
        "requests": args.requests,
        "n": args.n,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "stream_interval": args.stream_interval,
    }


def main() -> None:
    import uvloop

    args = parse_args()
    summary = uvloop.run(main_async(args))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
