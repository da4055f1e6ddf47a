"""A tiny random MoE causal LM and a character-level tokenizer, built locally (no downloads).

The demo and the tests use it. The architecture is Qwen3-MoE (supported by transformers, vLLM and
megatron-bridge) at toy size: head_dim 32 because vLLM's CPU attention rejects 16.
"""

from __future__ import annotations

import json
from pathlib import Path

# Specials first so their ids are stable: pad=0, bos=1, eos=2.
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>"]
CHARACTERS = list("0123456789abcdefghijklmnopqrstuvwxyz =+-*/:,.?!()")
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
DIGIT_IDS = list(range(3, 13))

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    "{% if reasoning_effort is defined %}{{ reasoning_effort[:1] }}{% endif %}"
)


def vocab() -> dict[str, int]:
    """Token string -> id, specials then single characters."""
    return {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}


def build_tokenizer():
    """A character-level `PreTrainedTokenizerFast` over `vocab()` with a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab=vocab(), unk_token="?"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_config(
    num_layers: int = 2,
    hidden_size: int = 64,
    num_experts: int = 8,
    top_k: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    head_dim: int = 32,
    moe_intermediate_size: int | None = None,
    dtype: str = "float32",
):
    """The Qwen3-MoE config of the tiny model (64-token vocabulary, untied LM head)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        moe_intermediate_size=moe_intermediate_size or hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        torch_dtype=dtype,
    )


def init_tiny_dense(path: str | Path, seed: int = 0) -> Path:
    """A tiny dense Qwen3 (2 layers, hidden 64, GQA 2/1 x 32, MLP 128, untied head) with the char tokenizer: vLLM's
    CPU engine serves LoRA adapters only on models without MoE layers."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        torch_dtype="float32",
    )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    return save_tiny_checkpoint(AutoModelForCausalLM.from_config(config, dtype=torch.float32), path)


# The GPU demo's model (``tiny_model: qwen3-moe-1b``): the same vocabulary and task, 0.94 B parameters (12 layers,
# hidden 1024, 48 experts top-4 of FFN 512, GQA 8/2 x 128), stored in bf16: large enough that the H200 runs real
# kernels (FlashAttention, fused MoE, CUDA graphs) and R3 has routing to replay.
GPU_DEMO_CONFIG = dict(
    num_layers=12,
    hidden_size=1024,
    num_experts=48,
    top_k=4,
    num_heads=8,
    num_kv_heads=2,
    head_dim=128,
    moe_intermediate_size=512,
    dtype="bfloat16",
)


def echo_corpus(num_rows: int, echo_prob: float, generator, num_digits: int = 3, response_len: int = 8):
    """Rows of ``<bos> d1..dk`` + a response whose tokens repeat dk with probability ``echo_prob``.

    A noisy "pre-training" corpus: a model fit to it starts the echo task with partial skill
    (reward about ``echo_prob``), which RL then sharpens.
    """
    import torch

    digits = torch.tensor(DIGIT_IDS)
    prompt = digits[torch.randint(len(DIGIT_IDS), (num_rows, num_digits), generator=generator)]
    noise = digits[torch.randint(len(DIGIT_IDS), (num_rows, response_len), generator=generator)]
    echo = torch.rand((num_rows, response_len), generator=generator) < echo_prob
    response = torch.where(echo, prompt[:, -1:].expand_as(noise), noise)
    bos = torch.full((num_rows, 1), BOS_ID)
    return torch.cat([bos, prompt, response], dim=1), 1 + num_digits


def warmup_echo(model, num_steps: int, echo_prob: float = 0.3, lr: float = 1e-2, seed: int = 0) -> float:
    """Short supervised warm-up on the noisy echo corpus (on the model's device); returns the last loss."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    loss = torch.tensor(float("nan"))
    device = next(model.parameters()).device
    for _ in range(num_steps):
        rows, prompt_len = echo_corpus(64, echo_prob, generator)
        rows = rows.to(device)
        logits = model(input_ids=rows, use_cache=False).logits[:, prompt_len - 1 : -1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, prompt_len:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return float(loss)


def init_tiny(
    path: str | Path, seed: int = 0, warmup_steps: int = 0, warmup_lr: float = 1e-2, **config_overrides
) -> Path:
    """Write the tiny MoE checkpoint and its tokenizer into `path`; returns the path.

    ``warmup_steps > 0`` first fits the random model briefly to the noisy echo corpus (see
    ``echo_corpus``) so that the demo's RL starts from partial skill instead of from scratch; on a GPU when
    there is one (fp32 there too), then stored in the config's dtype.
    """
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = tiny_config(**config_overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if warmup_steps:
        model.to("cuda" if torch.cuda.is_available() else "cpu")
        warmup_echo(model, warmup_steps, lr=warmup_lr, seed=seed)
    model = model.to("cpu", dtype=getattr(torch, config_overrides.get("dtype", "float32")))
    return save_tiny_checkpoint(model, path)


def save_tiny_checkpoint(model, path: Path) -> Path:
    """Write ``model`` with the char tokenizer and a neutral generation config into ``path``."""
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    # vLLM reads generation_config.json for default sampling; keep it neutral.
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID})
    )
    return path
