#!/usr/bin/env python
"""Tokens/s an agent gets through the session API against plain Generate on the same rollout server.

Run from the repository root on a machine with vLLM (CPU or GPU)::

    .venv/bin/python benchmarks/agent_overhead.py [--sessions 64 --max-tokens 64 --rounds 3]

On a GPU machine pass the engine's settings as ``rollout.*`` overrides (as benchmarks/rollout_overhead.py takes them),
e.g. ``rollout.dtype=bfloat16 rollout.gpu_memory_utilization=0.4``, and more sessions so a round lasts long enough
to time (docs/benchmarks.md has the command).

One rollout server process (the tiny MoE, random weights) and one coordinator process serving the agent API
(``agent.only_agents``: it generates nothing itself) against it, an embedded valkey. Same prompts, same sampling
(temperature 1, full vocabulary, EOS ends a sample on both sides, 16 tokens per streamed chunk: the agent API's
default, what ``Session.generate`` asks), all calls in flight at once:

(a) ``plain``: ``RolloutService.Generate`` straight to the rollout server (n = 1 per prompt);
(b) ``agent``: through the coordinator with the ``fleetrl.agent`` SDK: OpenSession, one Generate turn (the
    coordinator records it and forwards to the same server), CloseSession(abandon), per prompt.

Rounds alternate a, b, a, b, ... after one warm-up each; tokens/s are medians over rounds. Sample lengths are
random (EOS), so each side's rate is its tokens over its wall time. The last line printed is one JSON object:
``{"plain_tok_s": .., "agent_tok_s": .., "ratio": ..}`` (ratio = agent / plain, goal >= 0.95).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=64, help="prompts per round, all in flight at once")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per side")
    parser.add_argument(
        "--engine-cpus",
        default="auto",
        help="CPU engine: the cores its threads are bound to (VLLM_CPU_OMP_THREADS_BIND); '' = vLLM's default (all); "
        "auto = core 0 without a CUDA device, nothing bound with one (a GPU engine needs no cores of its own)",
    )
    parser.add_argument("--model", default="", help="checkpoint; default: a random tiny MoE built in a temp dir")
    parser.add_argument("overrides", nargs="*", help="rollout.* overrides for the server (GPU settings)")
    return parser.parse_args()


def engine_cores(choice: str) -> str:
    """The cores to bind the CPU engine to ('' = none): ``--engine-cpus``, with auto = '0' unless CUDA is there."""
    if choice != "auto":
        return choice
    import torch

    return "" if torch.cuda.is_available() else "0"


def prompts(args: argparse.Namespace) -> list[list[int]]:
    return [[1] + [3 + (i * 7 + j * 3) % 60 for j in range(args.prompt_len - 1)] for i in range(args.sessions)]


async def plain_round(stub, args: argparse.Namespace) -> tuple[int, float]:
    from protos import rollout_pb2 as pb

    sampling = pb.SamplingParams(n=1, max_tokens=args.max_tokens, temperature=1.0, top_p=1.0, stream_interval=16)

    async def one(prompt: list[int]) -> int:
        tokens = 0
        async for message in stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling), timeout=600):
            tokens += len(message.token_ids)
        return tokens

    started = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts(args)))
    return sum(counts), time.perf_counter() - started


async def agent_round(client, args: argparse.Namespace, round_index: int) -> tuple[int, float]:
    async def one(i: int, prompt: list[int]) -> int:
        session = await client.open_session(prompt, group_key=f"r{round_index}-{i}", group_size=1)
        try:
            turn = await session.generate(args.max_tokens)
        finally:
            await session.abandon()  # its slot goes back: the next round re-uses it
        return len(turn.token_ids)

    started = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts(args))))
    return sum(counts), time.perf_counter() - started


def start_coordinator(server_address: str, redis_url: str, workdir: Path) -> tuple[subprocess.Popen, int, str]:
    from launcher.redis_server import free_port

    token, port = secrets.token_urlsafe(16), free_port()
    tokens_file = workdir / "tokens.yaml"
    grant = {"name": "bench", "token": token, "scopes": ["generate", "submit"], "rate_per_s": 1e6}
    tokens_file.write_text(yaml.safe_dump({"tokens": [grant]}))
    config = {
        "run_id": "agent-bench",
        "redis_url": redis_url,
        "num_steps": 100000,
        "groups_per_step": 1,
        "max_staleness": 100000,  # no trainer runs: admission must not wait for one
        "coordinator": {"group_size": 1, "admin_port": 0},
        "agent": {"enabled": True, "only_agents": True, "port": port, "tokens_file": str(tokens_file)},
    }
    (workdir / "run.yaml").write_text(yaml.safe_dump(config))
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "coordinator",
            "run",
            "--config",
            str(workdir / "run.yaml"),
            "--servers",
            server_address,
        ],
        stdout=open(workdir / "coordinator.log", "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return process, port, token


async def wait_listening(port: int, process: subprocess.Popen, log: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the coordinator exited: {log.read_text()[-2000:]}")
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the agent API did not listen on {port} within {timeout_s}s") from None
            await asyncio.sleep(0.2)


async def main_async(args: argparse.Namespace) -> dict:
    from rollout_overhead import start_server

    from fleetrl.agent import AsyncAgentClient
    from launcher.redis_server import EmbeddedRedis
    from modeling.tiny_model import init_tiny

    workdir = Path(tempfile.mkdtemp(prefix="fleetrl-agent-bench-"))
    model = args.model or str(init_tiny(workdir / "tiny"))
    redis_server = EmbeddedRedis().start()
    server_args = argparse.Namespace(requests=args.sessions, overrides=args.overrides)
    engine_cpus = engine_cores(args.engine_cpus)
    if engine_cpus:  # the CPU engine on its own cores: the rest is fleetrl's
        os.environ.update(OMP_NUM_THREADS=str(len(engine_cpus.split(","))), VLLM_CPU_OMP_THREADS_BIND=engine_cpus)
    rollout, channel, stub, address = await start_server(model, server_args, workdir / "rollout.log")
    coordinator = None
    try:
        coordinator, port, token = start_coordinator(address, redis_server.url, workdir)
        await wait_listening(port, coordinator, workdir / "coordinator.log")
        results: dict[str, list[float]] = {"plain": [], "agent": []}
        async with AsyncAgentClient(f"127.0.0.1:{port}", token) as client:
            for round_index in range(args.rounds + 1):  # round 0 warms both up and is not counted
                for side in ("plain", "agent"):
                    if side == "plain":
                        tokens, seconds = await plain_round(stub, args)
                    else:
                        tokens, seconds = await agent_round(client, args, round_index)
                    label = "warm-up" if round_index == 0 else f"round {round_index}"
                    print(f"{label:8s} {side:5s} {tokens} tokens in {seconds:6.2f} s = {tokens / seconds:8.0f} tok/s")
                    if round_index:
                        results[side].append(tokens / seconds)
    finally:
        await channel.close()
        for process in (p for p in (coordinator, rollout) if p is not None):
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=60)
        redis_server.stop()
    plain, agent = statistics.median(results["plain"]), statistics.median(results["agent"])
    return {
        "plain_tok_s": round(plain, 1),
        "agent_tok_s": round(agent, 1),
        "ratio": round(agent / plain, 4),
        "sessions": args.sessions,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "engine_cpus": engine_cpus,
        "overrides": args.overrides,
    }


def main() -> None:
    import uvloop

    print(json.dumps(uvloop.run(main_async(parse_args()))))


if __name__ == "__main__":
    main()
