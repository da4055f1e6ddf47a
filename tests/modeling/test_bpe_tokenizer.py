"""The locally trained byte-level BPE tokenizer (modeling/bpe_tokenizer.py): round trips, the ChatML template, the
same vocabulary at every build, and what save_pretrained writes."""

from __future__ import annotations

import json

import pytest

from modeling.bpe_tokenizer import EOS_TOKEN, SPECIAL_TOKENS, VOCAB_SIZE, build_bpe_tokenizer

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer(shared_data_dir):
    return build_bpe_tokenizer(shared_data_dir / "dapo-math-sample.parquet")


@pytest.fixture(scope="module")
def shared_data_dir():
    # tests/conftest.py's shared_data fixture is function-scoped; the tokenizer is built once per module.
    from tests.conftest import SHARED_DATA

    if not SHARED_DATA.is_dir():
        pytest.skip(f"test data folder {SHARED_DATA} is absent (expected shared/ beside the repo)")
    return SHARED_DATA


def test_text_with_multibyte_characters_round_trips(tokenizer):
    text = "Résumé: 3×4 = 12 — ∑ x² ≤ π, 你好 🙂\n$\\frac{a}{b}$"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert max(ids) < VOCAB_SIZE and tokenizer.unk_token_id is None  # byte-level: nothing is unknown


def test_merges_make_math_text_shorter_than_its_bytes(tokenizer):
    text = "Find the number of positive integers $n$ such that $\\sqrt{n}$ is an integer."
    assert len(tokenizer.encode(text, add_special_tokens=False)) < len(text.encode()) / 2.5


def test_chat_template_renders_system_and_user_with_the_generation_prompt(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1+1?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 1+1?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3  # each marker is one special token
    assert ids.count(tokenizer.eos_token_id) == 2


def test_chat_template_reads_enable_thinking(tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_specials_have_fixed_ids(tokenizer):
    assert tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS) == list(range(len(SPECIAL_TOKENS)))
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token) == (0, 0, EOS_TOKEN)
    assert len(tokenizer) == VOCAB_SIZE


def test_every_build_has_the_same_vocabulary_and_merges(tokenizer, shared_data_dir):
    again = build_bpe_tokenizer(shared_data_dir / "dapo-math-sample.parquet")
    first, second = (json.loads(t.backend_tokenizer.to_str())["model"] for t in (tokenizer, again))
    assert first["vocab"] == second["vocab"] and first["merges"] == second["merges"]


def test_saved_tokenizer_keeps_the_template_in_tokenizer_config(tokenizer, tmp_path):
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(tmp_path, save_jinja_files=False)
    assert "chat_template" in json.loads((tmp_path / "tokenizer_config.json").read_text())
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.chat_template == tokenizer.chat_template and loaded.get_vocab() == tokenizer.get_vocab()
