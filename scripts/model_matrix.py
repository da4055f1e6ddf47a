"""The model-family matrix (issue 28): every family of ``modeling.families`` through fleetrl's path on CPU.

Per family, a tiny random checkpoint (``modeling.families.init_family``) and four checks:

1. serve: vLLM's CPU engine (``rollout_service.engine.RolloutEngine``) starts on it and samples 8 tokens;
2. bridge: megatron-bridge imports it (``trainer_service.megatron.backend.MegatronBackend``) and exports every tensor
   back with the checkpoint's name, shape and exact values, and the Megatron model's log-probs of 24 fixed tokens
   equal transformers' (mean ``|dlogp| <= 1e-4``);
3. logprobs: the torch trainer's (``TorchBackend``) log-probs of the sampled tokens equal the engine's, fp32 mean
   ``|dlogp| <= 1e-4``;
4. update: the trainer's weights moved by one seeded perturbation are packed as the weight bus packs them
   (``weight_bus.packing``), committed into the running engine (``RolloutEngine.commit_weights``), and the engine's
   log-probs of a fresh sample then equal the trainer's new ones (mean ``|dlogp| <= 1e-4``) while differing from the
   old ones: the served weights are the trainer's.

Each family runs in its own processes (the engine checks in one, the bridge in another), so one family's crash is
that family's row. Writes ``docs/models.md`` and ``docs/model-matrix.json``.

    nice -n 10 .venv/bin/python scripts/model_matrix.py            # every family
    .venv/bin/python scripts/model_matrix.py --families qwen3 gpt_oss --no-docs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(Path(__file__).resolve().parent))

from model_matrix_page import (  # noqa: E402
    BF16_TOLERANCE,
    CHECKS,
    ENGINE_DTYPE,
    TOLERANCE,
    render,
    write_models_page,
)

from modeling.families import FAMILIES, init_family  # noqa: E402

PROMPT = [1, 4, 5, 6, 7]
NUM_TOKENS = 8
FAMILY_TIMEOUT_S = 420


def _error(exc: BaseException) -> str:
    """The exception's type and first line, plus the innermost frame (where upstream gave up)."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" [{Path(frames[-1].filename).name}:{frames[-1].lineno}]" if frames else ""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {message[:300]}{where}"


# -- checks 1, 3, 4: one engine ---------------------------------------------------------------------------------


async def _sample(engine, seed: int) -> tuple[list[int], list[float]]:
    from rollout_service.engine import SamplingRequest

    request = SamplingRequest(PROMPT, 1, NUM_TOKENS, 1.0, 1.0, -1, 0.0, [], seed, 0, True, request_id=f"s{seed}")
    tokens: list[int] = []
    logprobs: list[float] = []
    async for chunk in engine.generate(request):
        tokens += chunk.token_ids
        logprobs += chunk.logprobs
    return tokens, logprobs


def _trainer_logprobs(backend, tokens: list[int]) -> list[float]:
    import torch

    from trainer_service.torch_backend import token_logprobs

    ids = torch.tensor([PROMPT + tokens])
    with torch.no_grad():
        logprobs = token_logprobs(backend.model, ids, torch.ones_like(ids), 1.0)
    return logprobs[0, len(PROMPT) - 1 :].tolist()


def _mean_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == NUM_TOKENS, (len(a), len(b))
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


def _perturb(backend, seed: int) -> None:
    """Move every trainer weight by seeded noise (std 0.02): a stand-in for one RL step's update."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in backend.model.parameters():
            param.add_(0.02 * torch.randn(param.shape, generator=generator, dtype=param.dtype))


def _stage(backend, directory: Path, version: int) -> tuple[str, bytes]:
    import numpy as np

    from protos.records import encode
    from weight_bus import packing

    manifest, buckets = packing.pack(backend.export_hf_weights(), version, 64 * 2**20)
    path = directory / f"staged-v{version}"
    path.write_bytes(b"".join(np.asarray(b).tobytes() for b in buckets))
    return str(path), encode(manifest)


async def engine_checks(model: str, results: dict) -> None:
    """Checks 1, 3 and 4 on one engine; fills ``results`` as each finishes (a failure leaves the rest unset)."""
    from protos.config import RolloutConfig, TrainerConfig
    from rollout_service.engine import RolloutEngine
    from trainer_service.torch_backend import TorchBackend

    dtype = ENGINE_DTYPE.get(Path(model).name, "float32")
    tolerance = TOLERANCE if dtype == "float32" else BF16_TOLERANCE
    engine = RolloutEngine(model, RolloutConfig(max_model_len=256, dtype=dtype))
    try:
        started = time.monotonic()
        await engine.start()
        tokens, engine_logprobs = await _sample(engine, seed=1)
        assert len(tokens) == NUM_TOKENS, tokens
        results["serve"] = {
            "status": "pass",
            "detail": f"{NUM_TOKENS} tokens, engine up in {time.monotonic() - started:.0f} s",
        }
        results["update"] = {"status": "fail", "detail": "not reached: check 3 failed"}
        backend = TorchBackend(model, TrainerConfig())
        diff = _mean_abs_diff(_trainer_logprobs(backend, tokens), engine_logprobs)
        where = "" if dtype == "float32" else f" (engine {dtype}, tolerance {tolerance:g})"
        detail = f"mean |dlogp| {diff:.1e}{where}"
        results["logprobs"] = {"status": "pass" if diff <= tolerance else "fail", "detail": detail}
        _perturb(backend, seed=2)
        with tempfile.TemporaryDirectory() as directory:
            path, manifest = _stage(backend, Path(directory), 1)
            await engine.commit_weights(1, path, manifest)
        tokens, engine_logprobs = await _sample(engine, seed=3)
        new_diff = _mean_abs_diff(_trainer_logprobs(backend, tokens), engine_logprobs)
        backend_before = TorchBackend(model, TrainerConfig())
        moved = _mean_abs_diff(_trainer_logprobs(backend_before, tokens), engine_logprobs)
        ok = new_diff <= tolerance < moved
        detail = f"after the update mean |dlogp| {new_diff:.1e} to the trainer (to the old weights {moved:.1e}){where}"
        results["update"] = {"status": "pass" if ok else "fail", "detail": detail}
    finally:
        engine.shutdown()


# -- check 2: megatron-bridge round trip --------------------------------------------------------------------------


# Trainer settings a family needs, each the one fleetrl's own refusal asks for: gpt-oss's experts have biases, which
# grouped experts do not implement.
MEGATRON_SETTINGS = {"gpt_oss": {"moe_grouped_experts": False}}


def bridge_check(model: str, results: dict) -> None:
    import torch
    from safetensors.torch import load_file

    from protos.config import TrainerConfig
    from trainer_service.megatron.backend import MegatronBackend

    original = {}
    for file in sorted(Path(model).glob("*.safetensors")):
        original.update(load_file(file))
    settings = MEGATRON_SETTINGS.get(Path(model).name, {})
    backend = MegatronBackend(model, TrainerConfig(backend="megatron", megatron=settings))
    exported = {name: tensor.detach().cpu() for name, tensor in backend.export_hf_weights()}
    missing, extra = sorted(set(original) - set(exported)), sorted(set(exported) - set(original))
    differ = [
        n for n in set(original) & set(exported) if not torch.equal(original[n], exported[n].to(original[n].dtype))
    ]
    ok = not (missing or extra or differ)
    detail = f"{len(exported)}/{len(original)} tensors exact"
    if not ok:
        detail = f"missing {missing[:3]} extra {extra[:3]} differ {sorted(differ)[:3]} ({len(differ)} differ)"
    # The same weights must also compute the same function: Megatron's log-probs against transformers' own model.
    diff = _megatron_vs_hf_logprobs(backend, model)
    ok = ok and diff <= TOLERANCE
    results["bridge"] = {"status": "pass" if ok else "fail", "detail": f"{detail}; log-probs vs HF {diff:.1e}"}


def _megatron_vs_hf_logprobs(backend, model: str) -> float:
    """Mean |dlogp| of the Megatron backend against the torch trainer (transformers' model) on 24 fixed tokens."""
    import torch

    from protos.config import TrainerConfig
    from trainer_service.torch_backend import TorchBackend, token_logprobs

    ids = torch.tensor([PROMPT + list(range(8, 27))])  # 24 tokens: longer than gpt-oss's sliding window (16)
    mask = torch.ones_like(ids)
    megatron_logprobs = backend.token_logprobs(ids, mask)
    with torch.no_grad():
        hf_logprobs = token_logprobs(TorchBackend(model, TrainerConfig()).model, ids, mask, 1.0)
    return (megatron_logprobs - hf_logprobs).abs().mean().item()


# -- driver ----------------------------------------------------------------------------------------------------------


def run_one(family: str, part: str, directory: str) -> dict:
    """One family's ``part`` ('engine' or 'bridge') in this process; returns its results."""
    results: dict = {}
    model = str(Path(directory) / family)
    try:
        if part == "engine":
            asyncio.run(engine_checks(model, results))
        else:
            bridge_check(model, results)
    except Exception as exc:  # the family's row records the exact error instead of ending the matrix
        names = ("serve", "logprobs", "update") if part == "engine" else ("bridge",)
        for name in names:
            if name not in results or (name == "update" and results[name]["detail"].startswith("not reached")):
                results[name] = {"status": "fail", "detail": _error(exc)}
    return results


WRAPPERS = ("See root cause above", "See stack trace", "EngineDeadError", "Engine core initialization failed")


def _with_root_cause(results: dict, stderr: str) -> dict:
    """vLLM's front end raises a wrapper ("see root cause above") while the cause is in the engine core's log: add
    the first exception line of that log that is not a wrapper."""
    causes = [
        re.sub(r"^\(.*?\) \w+ [\d-]+ [\d:]+ \[[^\]]*\] ", "", line.strip())  # vLLM's log prefix
        for line in stderr.splitlines()
        if re.search(r"\b\w*(Error|Exception): ", line) and not any(w in line for w in WRAPPERS)
    ]
    for check in results.values():
        if causes and any(w in check["detail"] for w in WRAPPERS):
            check["detail"] = f"{check['detail'].split(':')[0]}; root cause: {causes[0][:400]}"
    return results


def run_family(family: str, directory: str) -> dict:
    """Build the checkpoint, then run the engine and bridge parts each in a child process."""
    row: dict = {"family": family}
    started = time.monotonic()
    try:
        init_family(family, Path(directory) / family)
    except Exception as exc:  # a config transformers cannot build: every check fails with that error
        return row | {name: {"status": "fail", "detail": f"build: {_error(exc)}"} for name in CHECKS}
    for part in ("engine", "bridge"):
        command = [sys.executable, __file__, "--one", family, "--part", part, "--dir", directory]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=FAMILY_TIMEOUT_S, cwd=ROOT)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if lines:
                row.update(_with_root_cause(json.loads(lines[-1][len("RESULT ") :]), done.stdout + done.stderr))
            else:
                tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
                row[part] = {"status": "fail", "detail": f"process exited {done.returncode}: {tail}"}
        except subprocess.TimeoutExpired:
            row[part] = {"status": "fail", "detail": f"timed out after {FAMILY_TIMEOUT_S} s"}
    for name in CHECKS:
        row.setdefault(name, {"status": "fail", "detail": row.get("engine", {}).get("detail", "not run")})
    row.pop("engine", None)
    row["seconds"] = round(time.monotonic() - started, 1)
    return row


def _merged_rows(paths: list[str]) -> list[dict]:
    """Rows of several runs by family, in the order of ``FAMILIES``."""
    by_family: dict[str, dict] = {}
    for path in paths:
        text = Path(path).read_text().strip()
        rows = json.loads(text) if text.startswith("[") else [json.loads(line) for line in text.splitlines()]
        by_family.update({row["family"]: row for row in rows if _is_row(row)})
    return [by_family[family] for family in FAMILIES if family in by_family]


def _is_row(row: object) -> bool:
    return isinstance(row, dict) and "family" in row and all(name in row for name in CHECKS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", default=list(FAMILIES))
    parser.add_argument("--no-docs", action="store_true", help="print the JSON, write nothing under docs/")
    parser.add_argument(
        "--render",
        nargs="+",
        metavar="ROWS",
        help="write docs/ from rows printed by earlier runs (JSON lines or a JSON list; later files win), run nothing",
    )
    parser.add_argument("--command", default="", help="with --render: the commands that made the rows, for the docs")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--part", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, args.part, args.dir)), flush=True)
        return
    where = f"CPU ({platform.machine()}, {platform.processor() or 'cpu'}), vLLM CPU backend, torch trainer, fp32"
    where += "".join(f" ({family}'s engine {dtype})" for family, dtype in ENGINE_DTYPE.items())
    command = "nice -n 10 .venv/bin/python scripts/model_matrix.py" + (
        "" if args.families == list(FAMILIES) else " --families " + " ".join(args.families)
    )
    if args.render:
        rows = _merged_rows(args.render)
        (ROOT / "docs" / "model-matrix.json").write_text(json.dumps(rows, indent=2) + "\n")
        write_models_page(render(rows, args.command or command, where))
        return
    with tempfile.TemporaryDirectory() as directory:
        rows = []
        for family in args.families:
            rows.append(run_family(family, directory))
            print(json.dumps(rows[-1]), flush=True)
            if not args.no_docs:  # after every family, so a long run's finished rows are never lost
                (ROOT / "docs" / "model-matrix.json").write_text(json.dumps(rows, indent=2) + "\n")
                write_models_page(render(rows, command, where))


if __name__ == "__main__":
    main()
