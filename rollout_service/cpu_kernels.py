"""What an engine on vLLM's CPU platform must ask for, given the checkpoint and the engine's dtype.

vLLM's CPU platform picks kernels by what the CPU has: on one with AMX tiles it takes its AMX MLA attention, which
loads bf16 weights only ("expect weight to be bfloat16 ..." at start), so an fp32 engine of an MLA model must ask for
the reference CPU MLA backend.
"""

from __future__ import annotations

import json
from pathlib import Path


def engine_kwargs(model_path: str, dtype: str) -> dict:
    """``AsyncEngineArgs`` a CPU engine of ``model_path`` in ``dtype`` must add to vLLM's own choices."""
    if dtype in ("float32", "float") and uses_mla(model_path):
        return {"attention_backend": "CPU_MLA"}
    return {}


def uses_mla(model_path: str) -> bool:
    """Whether the local checkpoint at ``model_path`` has multi-head latent attention (DeepSeek-V3's MLA: a KV LoRA
    rank in its config); False for a path without a config.json (a hub name)."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        return False
    config = json.loads(config_file.read_text())
    text_config = config.get("text_config") or config
    return bool(text_config.get("kv_lora_rank"))
