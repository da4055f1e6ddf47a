"""A small byte-level BPE tokenizer with a ChatML chat template, trained locally (no downloads).

Users arrive with a checkpoint whose tokenizer is byte-level BPE with special tokens and a Jinja chat template
(Qwen's ChatML). The tiny models' 64-character vocabulary exercises none of that: merges that cross characters,
multi-byte text, a template that renders roles and a generation prompt, two end tokens. This tokenizer does, at
toy size: a few thousand tokens trained on the problems of the DAPO-Math slice in ``shared/data`` (a fixed file,
so the vocabulary is the same at every build and on every commit), in a second or two.
"""

from __future__ import annotations

from pathlib import Path

# shared/ lies beside the repository (the recipes' ../shared/data).
DAPO_SLICE = Path(__file__).resolve().parents[2] / "shared" / "data" / "dapo-math-sample.parquet"
NUM_CORPUS_ROWS = 4000  # enough text for stable merges; reading and training on it takes about a second
# Not a multiple of 128: a checkpoint pads its embedding rows above it, as Qwen's 151936 rows for 151665 tokens.
VOCAB_SIZE = 4000

# Qwen's specials, first so their ids are stable: <|endoftext|> is pad (and bos, as Qwen's config.json has it),
# <|im_end|> ends an assistant turn (eos); the thinking markers are Qwen3's.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
PAD_TOKEN = BOS_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"

# Qwen2.5 / Qwen3's ChatML without tools: one block per message, then the assistant's opening when asked.
# ``enable_thinking=false`` (a chat_template_kwargs key, as Qwen3's template reads it) opens an empty think block.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


def corpus_texts(path: str | Path = DAPO_SLICE, num_rows: int = NUM_CORPUS_ROWS) -> list[str]:
    """The first ``num_rows`` problem texts of the DAPO-Math slice (its ``prompt`` column of chat messages)."""
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"the BPE tokenizer's corpus {path} is absent (expected shared/ beside the repo)")
    prompts = pq.read_table(path, columns=["prompt"]).slice(0, num_rows).column("prompt").to_pylist()
    return [message["content"] for messages in prompts for message in messages]


def train_bpe(texts: list[str], vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts``, the specials first (ids 0..4)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    core = Tokenizer(models.BPE())
    # GPT-2's split regex then bytes -> printable characters: every string encodes, nothing is unknown.
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer=trainer)
    return core


def build_bpe_tokenizer(corpus: str | Path = DAPO_SLICE, vocab_size: int = VOCAB_SIZE):
    """The BPE tokenizer as a ``PreTrainedTokenizerFast`` with the ChatML template (save it with
    ``save_pretrained``: tokenizer.json and tokenizer_config.json with ``chat_template``)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(corpus_texts(corpus), vocab_size),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=SPECIAL_TOKENS[1:2] + SPECIAL_TOKENS[3:],
        model_max_length=1 << 20,  # the model's max_position_embeddings is the limit, not the tokenizer's
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
