"""The demo's tiny models, built once per source and warm-up and cached under ``$FLEETRL_CACHE`` (default
``~/.cache/fleetrl``): what ``fleetrl demo`` trains when no ``model_path`` is given."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

WARMUP_STEPS = 150


def tiny_model_dir(family: str = "qwen3-moe", warmup_steps: int = WARMUP_STEPS) -> Path:
    """Build (once, cached) the demo's tiny MoE of ``family`` with its short echo warm-up; returns its directory."""
    from modeling import tiny_model

    if family == "beam":
        from modeling.beam import tiny as builder

        sources = [Path(tiny_model.__file__)] + sorted(Path(builder.__file__).parent.glob("*.py"))
        build = builder.init_tiny_beam
    elif family == "qwen3-moe-1b":
        sources = [Path(tiny_model.__file__)]

        def build(path, warmup_steps):  # a lower warm-up lr than the tiny model's: 0.94 B parameters
            return tiny_model.init_tiny(path, warmup_steps=warmup_steps, warmup_lr=1e-3, **tiny_model.GPU_DEMO_CONFIG)
    else:
        sources, build = [Path(tiny_model.__file__)], tiny_model.init_tiny
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources) + str(warmup_steps).encode()).hexdigest()[:12]
    prefix = {"beam": "tiny-beam-echo", "qwen3-moe-1b": "gpu-demo-1b-echo"}.get(family, "tiny-echo")
    cache = Path(os.environ.get("FLEETRL_CACHE", Path.home() / ".cache" / "fleetrl")) / f"{prefix}-{digest}"
    if not (cache / "config.json").exists():
        partial = cache.with_suffix(".partial")
        shutil.rmtree(partial, ignore_errors=True)
        print(f"building the tiny {family} model (warm-up {warmup_steps} steps) into {cache} ...", flush=True)
        build(partial, warmup_steps=warmup_steps)
        partial.rename(cache)
    return cache
