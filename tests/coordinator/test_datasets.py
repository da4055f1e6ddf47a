"""Tests for coordinator.datasets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordinator.datasets import (
    DEFAULT_PROMPT_TEMPLATE,
    Problem,
    PromptSource,
    load_dataset,
    render_prompt,
)

pytestmark = pytest.mark.unit

INSTRUCTION = "\n\nPlease reason step by step, and put your final answer within \\boxed{}."


@pytest.mark.parametrize(
    ("filename", "rows", "source"),
    [
        ("aime-2024.jsonl", 30, "aime-2024"),
        ("aime-2025.jsonl", 30, "aime-2025"),
        ("aime-2024.parquet", 30, "aime24"),
        ("dapo-math-sample.parquet", 17917, "DAPO-17k"),
    ],
)
def test_load_all_files(shared_data: Path, filename: str, rows: int, source: str) -> None:
    problems = load_dataset(shared_data / filename)
    assert len(problems) == rows
    assert all(isinstance(p, Problem) for p in problems)
    assert {p.data_source for p in problems} == {source}
    assert len({p.problem_id for p in problems}) == rows
    for p in problems:
        assert p.ground_truth.strip()
        assert p.messages and p.messages[-1]["role"] == "user"
        assert all(m["content"].strip() for m in p.messages)


def test_plain_jsonl_uses_template(shared_data: Path) -> None:
    first = load_dataset(shared_data / "aime-2024.jsonl", limit=1)[0]
    assert first.problem_id == "2024-I-1"
    assert first.ground_truth == "204"
    content = first.messages[0]["content"]
    assert content.startswith("Every morning Aya")
    assert content.endswith(INSTRUCTION)
    custom = load_dataset(shared_data / "aime-2025.jsonl", prompt_template="Q: {problem} A:", limit=2)
    assert custom[0].messages == [
        {
            "role": "user",
            "content": "Q: Find the sum of all integer bases $b>9$ for which $17_{b}$ is a divisor of $97_{b}$. A:",
        }
    ]


def test_name_only_used_without_data_source_column(shared_data: Path) -> None:
    assert load_dataset(shared_data / "aime-2025.jsonl", name="aime25", limit=1)[0].data_source == ("aime25")
    assert load_dataset(shared_data / "aime-2024.parquet", name="x", limit=1)[0].data_source == ("aime24")


def test_verl_parquet_matches_jsonl_answers(shared_data: Path) -> None:
    parquet = load_dataset(shared_data / "aime-2024.parquet")
    plain = load_dataset(shared_data / "aime-2024.jsonl")
    # The parquet's prompt already includes the instruction and is kept
    # verbatim, so it equals the templated jsonl prompt. Row orders differ.
    by_prompt = {p.messages[0]["content"]: p for p in plain}
    assert len(by_prompt) == 30
    for p in parquet:
        twin = by_prompt[p.messages[0]["content"]]
        assert int(p.ground_truth) == int(twin.ground_truth)
    assert parquet[0].problem_id == "60"
    assert "025" in {p.ground_truth for p in parquet}


def test_dapo_limit_and_chat_templating(shared_data: Path) -> None:
    path = shared_data / "dapo-math-sample.parquet"
    bare = load_dataset(path, limit=3)
    assert len(bare) == 3
    assert bare[0].ground_truth == "34" and bare[0].problem_id == "0"
    assert not bare[0].messages[0]["content"].endswith(INSTRUCTION)
    wrapped = load_dataset(path, limit=3, template_chat_prompts=True)
    assert wrapped[0].messages[0]["content"] == bare[0].messages[0]["content"] + INSTRUCTION
    assert load_dataset(path, limit=0) == []


def _write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_question_alias_and_default_source(tmp_path: Path) -> None:
    path = _write_jsonl(
        tmp_path / "mini.jsonl",
        [
            json.dumps({"question": "1+1?", "answer": 2}),
            "",
            json.dumps({"id": "b", "problem": "2+2?", "answer": "4"}),
        ],
    )
    problems = load_dataset(path)
    assert [p.problem_id for p in problems] == ["line-1", "b"]
    assert [p.ground_truth for p in problems] == ["2", "4"]
    assert problems[0].data_source == "mini"
    expected = DEFAULT_PROMPT_TEMPLATE.replace("{problem}", "1+1?")
    assert problems[0].messages[0]["content"] == expected


def test_malformed_json_line_names_line(tmp_path: Path) -> None:
    ok = json.dumps({"problem": "p", "answer": "1"})
    path = _write_jsonl(tmp_path / "bad.jsonl", [ok, ok, '{"problem": "p", "answer":'])
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 3: invalid JSON"):
        load_dataset(path)


def test_missing_field_names_line_and_field(tmp_path: Path) -> None:
    path = _write_jsonl(
        tmp_path / "gap.jsonl",
        [
            json.dumps({"problem": "p", "answer": "1"}),
            json.dumps({"problem": "q"}),
        ],
    )
    with pytest.raises(ValueError, match=r"gap\.jsonl: line 2: missing field 'answer'"):
        load_dataset(path)
    path = _write_jsonl(tmp_path / "noq.jsonl", [json.dumps({"answer": "1"})])
    with pytest.raises(ValueError, match=r"line 1: missing field 'problem'"):
        load_dataset(path)


def test_malformed_parquet_row_names_row_and_field(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = {
        "data_source": "s",
        "prompt": [{"role": "user", "content": "x"}],
        "reward_model": {"ground_truth": "1", "style": "rule"},
    }
    bad = {
        "data_source": "s",
        "prompt": [{"role": "user", "content": "y"}],
        "reward_model": {"ground_truth": None, "style": "rule"},
    }
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([good, bad]), path)
    with pytest.raises(ValueError, match=r"bad\.parquet: row 1: .*reward_model\.ground_truth"):
        load_dataset(path)


def test_unknown_extension_and_schema(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unsupported extension"):
        load_dataset(tmp_path / "data.csv")
    path = _write_jsonl(tmp_path / "odd.jsonl", [json.dumps({"text": "hi"})])
    with pytest.raises(ValueError, match=r"odd\.jsonl: line 1: unknown schema"):
        load_dataset(path)


def _problems(n: int) -> list[Problem]:
    return [Problem(str(i), [{"role": "user", "content": str(i)}], str(i), "t") for i in range(n)]


def _take(source: PromptSource, count: int) -> list[tuple[int, int]]:
    return [(epoch, index) for epoch, index, _ in (next(source) for _ in range(count))]


def test_prompt_source_epochs_are_deterministic_permutations() -> None:
    problems = _problems(10)
    items = _take(PromptSource(problems, seed=3), 30)
    assert items == _take(PromptSource(problems, seed=3), 30)
    assert items != _take(PromptSource(problems, seed=4), 30)
    epochs = [[i for e, i in items if e == epoch] for epoch in range(3)]
    assert all(sorted(order) == list(range(10)) for order in epochs)
    assert epochs[0] != epochs[1]
    epoch, index, problem = next(PromptSource(problems, shuffle=False))
    assert (epoch, index, problem) == (0, 0, problems[0])


def test_prompt_source_resume() -> None:
    problems = _problems(7)
    source = PromptSource(problems, seed=11)
    _take(source, 9)
    state = json.loads(json.dumps(source.state()))
    assert all(isinstance(v, int) for v in state.values())
    expected = _take(source, 20)
    resumed = PromptSource(problems, seed=11)
    resumed.load_state(state)
    assert _take(resumed, 20) == expected
    with pytest.raises(ValueError, match="seed"):
        PromptSource(problems, seed=12).load_state(state)
    with pytest.raises(ValueError, match="problems"):
        PromptSource(_problems(8), seed=11).load_state(state)
    with pytest.raises(ValueError):
        PromptSource([])


_CHARS = "abcdefghijklmnopqrstuvwxyz<>=\n "
_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>effort={{ reasoning_effort | default('none') }}\n"
    "{% endif %}"
)


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{c: i + 1 for i, c in enumerate(_CHARS)}}
    model = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Splitting on the empty pattern makes every character a token.
    model.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>")


def _text(ids: list[int]) -> str:
    return "".join(_CHARS[i - 1] for i in ids)


def test_render_prompt_passes_template_kwargs() -> None:
    tokenizer = _tiny_tokenizer()
    messages = [{"role": "user", "content": "hi there"}]
    with pytest.raises(ValueError, match="no chat template"):
        render_prompt(tokenizer, messages, {})
    tokenizer.chat_template = _TEMPLATE
    ids = render_prompt(tokenizer, messages, {"reasoning_effort": "high"})
    assert all(isinstance(i, int) for i in ids)
    assert _text(ids) == "<user>hi there\n<assistant>effort=high\n"
    assert _text(render_prompt(tokenizer, messages, {})).endswith("effort=none\n")
    with pytest.raises(ValueError, match="tokenize"):
        render_prompt(tokenizer, messages, {"tokenize": False})
