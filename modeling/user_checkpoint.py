"""A tiny checkpoint of a matrix family laid out as a user's Hugging Face checkpoint would be (no downloads).

The matrix checkpoints (``modeling.families``) carry the 64-token character vocabulary. A user's checkpoint has a
byte-level BPE tokenizer with a chat template in tokenizer_config.json, a config ``vocab_size`` padded above the
tokenizer's length (Qwen's 151936 rows for 151665 tokens: the engine and the trainer see rows no text decodes
to), several end tokens in generation_config.json and a longer context. This one has all of that at toy size,
with ``modeling.bpe_tokenizer``'s tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

from modeling.bpe_tokenizer import DAPO_SLICE, build_bpe_tokenizer
from modeling.families import FAMILIES

PAD_MULTIPLE = 128  # the embedding rows: the tokenizer length (4000) rounded up, as real checkpoints pad it
MAX_POSITION_EMBEDDINGS = 1024


def padded_vocab_size(num_tokens: int, multiple: int = PAD_MULTIPLE) -> int:
    return -(-num_tokens // multiple) * multiple


def user_config(family: str, tokenizer):
    """The family's tiny matrix config with the BPE tokenizer's vocabulary (padded), specials and a longer context."""
    config = FAMILIES[family]()
    config.vocab_size = padded_vocab_size(len(tokenizer))
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    config.max_position_embeddings = MAX_POSITION_EMBEDDINGS
    return config


def init_user_checkpoint(
    path: str | Path, family: str = "qwen3_moe", seed: int = 0, corpus: str | Path = DAPO_SLICE
) -> Path:
    """Write a random tiny ``family`` model with the BPE tokenizer into ``path``; returns the path.

    Files: config.json and model.safetensors, tokenizer.json and tokenizer_config.json (with ``chat_template``, as
    Qwen's checkpoints keep it), generation_config.json (both of Qwen's end tokens, and its sampling defaults, which
    a run's own sampling settings must win over).
    """
    import torch
    from transformers import AutoModelForCausalLM

    if family == "beam":
        import modeling.beam  # noqa: F401 - registers model_type "beam" with transformers' Auto classes
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_bpe_tokenizer(corpus)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(user_config(family, tokenizer), dtype=torch.float32)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path, save_jinja_files=False)
    generation = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": [tokenizer.eos_token_id, tokenizer.pad_token_id],  # <|im_end|>, <|endoftext|>
        "pad_token_id": tokenizer.pad_token_id,
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
    }
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return path
