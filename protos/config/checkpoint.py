"""What the run's config reads from a local Hugging Face checkpoint: its context length (``rollout.max_model_len``).

Only JSON files are read (no transformers, no torch). The length is the one vLLM derives when it is given none
(``_get_and_verify_max_len`` and ``derive_max_model_len_and_key`` of vllm/config): the smallest of the length keys of
the text config (``text_config`` of a nested multimodal config), except that a ``model_max_length`` there wins
(Command-R); capped by tokenizer_config.json's ``model_max_length``; times the RoPE scaling factor of the rope types
whose ``max_position_embeddings`` is not already the scaled length (linear, dynamic). Reading it here puts the
length in the run's config before any process starts, so every role sees the same number.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

LENGTH_KEYS = (
    "max_position_embeddings",  # most families
    "n_positions",  # GPT-2
    "max_seq_len",  # MPT
    "seq_length",  # ChatGLM
    "model_max_length",  # Command-R
    "max_target_positions",  # Whisper
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
# Rope types whose max_position_embeddings is already the length the model reaches (vLLM applies no factor).
SCALED_ROPE_TYPES = ("default", "su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")
LONG_LENGTH_ENV = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"  # vLLM's own override of its refusal of a longer max_model_len


@dataclass(frozen=True)
class ContextLength:
    """A checkpoint's context length in tokens and where it comes from (for messages)."""

    tokens: int
    source: str


def checkpoint_context_length(model_path: str) -> ContextLength | None:
    """The context length of the checkpoint at ``model_path``; None when this machine holds no config.json there (a
    volume only the role machines mount) or it names no length."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        return None
    config = _read_json(config_file)
    text = config["text_config"] if isinstance(config.get("text_config"), dict) else config
    found = {key: int(text[key]) for key in LENGTH_KEYS if _is_number(text.get(key))}
    if not found:
        return None
    key = "model_max_length" if "model_max_length" in found else min(found, key=found.__getitem__)
    length = ContextLength(found[key], f"{key} in {config_file}")
    tokenizer_file = Path(model_path) / "tokenizer_config.json"
    tokenizer_limit = _read_json(tokenizer_file).get("model_max_length") if tokenizer_file.is_file() else None
    if _is_number(tokenizer_limit) and tokenizer_limit < length.tokens:
        length = ContextLength(int(tokenizer_limit), f"model_max_length in {tokenizer_file}")
    factor = _rope_factor(config.get("model_type", ""), text)
    if factor != 1.0:
        length = ContextLength(int(length.tokens * factor), f"{length.source} x RoPE scaling factor {factor:g}")
    return length


def resolve_max_model_len(model_path: str, max_model_len: int | None) -> int | None:
    """``rollout.max_model_len`` for an engine of ``model_path``: unset (None), the checkpoint's context length; set,
    itself, refused above the checkpoint's (unless vLLM's own override is set). Where this machine cannot read the
    checkpoint, unchanged: each role resolves it where it runs."""
    length = checkpoint_context_length(model_path)
    if length is None:
        config_file = Path(model_path) / "config.json"
        if max_model_len is None and config_file.is_file():
            raise ValueError(
                f"rollout.max_model_len is unset and {config_file} names no context length "
                f"({', '.join(LENGTH_KEYS[:4])}, ...): set rollout.max_model_len"
            )
        if max_model_len is None:
            logger.debug("rollout.max_model_len unset and no %s here: each role reads it where it runs", config_file)
        return max_model_len
    if max_model_len is None:
        logger.info("rollout.max_model_len = %d, the checkpoint's (%s)", length.tokens, length.source)
        return length.tokens
    if max_model_len > length.tokens:
        message = (
            f"rollout.max_model_len={max_model_len} is above the checkpoint's context length {length.tokens} "
            f"({length.source})"
        )
        if os.environ.get(LONG_LENGTH_ENV, "0").strip().lower() not in ("1", "true"):
            raise ValueError(f"{message}: lower it, or unset it to take {length.tokens}")
        logger.warning("%s; kept because %s is set (positions beyond it are untrained)", message, LONG_LENGTH_ENV)
    return max_model_len


def _read_json(path: Path) -> dict[str, Any]:
    try:
        loaded = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"model_path: cannot read {path}: {error}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"model_path: {path} does not hold a JSON object")
    return loaded


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def _rope_factor(model_type: str, text: dict[str, Any]) -> float:
    """The RoPE scaling factor vLLM multiplies the length by (1.0 for most checkpoints)."""
    rope = text.get("rope_parameters") or text.get("rope_scaling")
    if not isinstance(rope, dict) or "gemma3" in model_type:  # Gemma 3's length is already scaled
        return 1.0
    per_layer = [rope] if "rope_type" in rope or "type" in rope else [v for v in rope.values() if isinstance(v, dict)]
    factor = 1.0
    for parameters in per_layer:
        if parameters.get("rope_type", parameters.get("type")) not in SCALED_ROPE_TYPES:
            factor = float(parameters.get("factor") or factor)
    return factor
