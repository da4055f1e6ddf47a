"""Prompt datasets: loading, epoch-wise shuffled iteration and prompt rendering.

Two on-disk layouts are supported, each as ``.jsonl`` or ``.parquet``:

* verl/DAPO schema: ``prompt`` (list of chat messages ``{role, content}``),
  ``reward_model`` (``{ground_truth, style}``), optional ``data_source``,
  ``extra_info`` and ``id``.
* plain schema: ``problem`` (or its alias ``question``) and ``answer``, with
  an optional ``id``. The user message is built from a prompt template.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_PROMPT_TEMPLATE = "{problem}\n\nPlease reason step by step, and put your final answer within \\boxed{}."

_CHAT_SCHEMA = "chat"
_PLAIN_SCHEMA = "plain"
_PROBLEM_KEYS = ("problem", "question")
_PARQUET_COLUMNS = ("id", "data_source", "prompt", "reward_model", "extra_info", "problem", "question", "answer")
_RESERVED_TEMPLATE_KWARGS = ("add_generation_prompt", "tokenize")


@dataclass(frozen=True)
class Problem:
    """One prompt with its reference answer.

    Attributes:
        problem_id: Identifier, unique within its data source.
        messages: Chat messages (``{"role": ..., "content": ...}``) to render.
        ground_truth: Reference answer, as text.
        data_source: Name of the dataset the problem came from.
    """

    problem_id: str
    messages: list[dict]
    ground_truth: str
    data_source: str


def load_dataset(
    path: str | Path,
    name: str | None = None,
    prompt_template: str = DEFAULT_PROMPT_TEMPLATE,
    limit: int | None = None,
    template_chat_prompts: bool = False,
) -> list[Problem]:
    """Loads problems from a ``.jsonl`` or ``.parquet`` file.

    Args:
        path: File to read; the extension selects the reader.
        name: Data source name used when rows carry no ``data_source``;
            defaults to the file stem.
        prompt_template: Template whose ``{problem}`` placeholder is replaced
            by the problem text (plain substitution, so other braces such as
            ``\\boxed{}`` need no escaping). Applied to plain-schema rows, and
            to chat-schema rows only if ``template_chat_prompts`` is set.
        limit: Keep only the first ``limit`` rows.
        template_chat_prompts: If True, the last user message of chat-schema
            rows is also passed through ``prompt_template`` (useful for
            files such as the DAPO sample whose prompts are bare problems).
            By default chat messages are kept verbatim.

    Returns:
        The problems, in file order.

    Raises:
        ValueError: On an unknown extension or schema, or a malformed row; the
            message names the file, the row and the missing or bad field.
        FileNotFoundError: If the file does not exist.
    """
    path = Path(path)
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if "{problem}" not in prompt_template:
        raise ValueError(f"prompt_template must contain '{{problem}}': {prompt_template!r}")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows = _read_jsonl(path, limit)
    elif suffix == ".parquet":
        rows = _read_parquet(path, limit)
    else:
        raise ValueError(f"{path}: unsupported extension {suffix!r} (expected .jsonl or .parquet)")
    default_source = name or path.stem
    chat_template = prompt_template if template_chat_prompts else None
    problems = []
    schema = None
    for where, row in rows:
        if schema is None:
            schema = _detect_schema(path, where, row)
        try:
            problem = _row_to_problem(schema, row, where, default_source, prompt_template, chat_template)
        except _RowError as err:
            raise ValueError(f"{path}: {where}: {err}") from None
        problems.append(problem)
    return problems


class _RowError(Exception):
    """A malformed row; the caller adds the file and row to the message."""


def _read_jsonl(path: Path, limit: int | None) -> list[tuple[str, dict]]:
    rows = []
    with path.open("r", encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if limit is not None and len(rows) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}: line {line_no}: invalid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}: line {line_no}: expected a JSON object, got {type(row).__name__}")
            rows.append((f"line {line_no}", row))
    return rows


def _read_parquet(path: Path, limit: int | None) -> list[tuple[str, dict]]:
    # Imported lazily so that importing this module stays cheap.
    import pyarrow.parquet as pq

    if not path.exists():
        raise FileNotFoundError(path)
    names = pq.read_schema(path).names
    # Reading only known columns skips large unused text such as solutions.
    columns = [c for c in _PARQUET_COLUMNS if c in names]
    table = pq.read_table(path, columns=columns)
    if limit is not None:
        table = table.slice(0, limit)
    return [(f"row {i}", row) for i, row in enumerate(table.to_pylist())]


def _detect_schema(path: Path, where: str, row: Mapping[str, Any]) -> str:
    if "prompt" in row or "reward_model" in row:
        return _CHAT_SCHEMA
    if any(k in row for k in _PROBLEM_KEYS) or "answer" in row:
        return _PLAIN_SCHEMA
    raise ValueError(
        f"{path}: {where}: unknown schema with fields {sorted(row)}; expected verl/DAPO "
        "('prompt', 'reward_model') or plain ('problem' or 'question', 'answer')"
    )


def _row_to_problem(
    schema: str,
    row: Mapping[str, Any],
    where: str,
    default_source: str,
    template: str,
    chat_template: str | None,
) -> Problem:
    data_source = row.get("data_source") or default_source
    if schema == _CHAT_SCHEMA:
        messages = _chat_messages(row.get("prompt"), chat_template)
        reward_model = row.get("reward_model")
        if not isinstance(reward_model, Mapping):
            raise _RowError("missing field 'reward_model'")
        ground_truth = _answer_text(reward_model.get("ground_truth"), "reward_model.ground_truth")
    else:
        text = next((row[k] for k in _PROBLEM_KEYS if row.get(k) is not None), None)
        if not isinstance(text, str) or not text.strip():
            raise _RowError("missing field 'problem' (or 'question')")
        messages = [{"role": "user", "content": template.replace("{problem}", text)}]
        ground_truth = _answer_text(row.get("answer"), "answer")
    return Problem(
        problem_id=_problem_id(row, where),
        messages=messages,
        ground_truth=ground_truth,
        data_source=str(data_source),
    )


def _chat_messages(prompt: Any, template: str | None) -> list[dict]:
    if not isinstance(prompt, list) or not prompt:
        raise _RowError("missing field 'prompt' (a non-empty list of chat messages)")
    messages = []
    for i, message in enumerate(prompt):
        if not isinstance(message, Mapping):
            raise _RowError(f"field 'prompt[{i}]' is not a message object")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise _RowError(f"missing field 'prompt[{i}].{key}'")
        # Parquet structs carry every struct field, as None where absent.
        messages.append({k: v for k, v in message.items() if v is not None})
    if template is not None:
        users = [m for m in messages if m["role"] == "user"]
        if not users:
            raise _RowError("field 'prompt' has no user message to apply the template to")
        users[-1]["content"] = template.replace("{problem}", users[-1]["content"])
    return messages


def _answer_text(value: Any, field: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise _RowError(f"missing field '{field}'")
    text = str(value).strip()
    if not text:
        raise _RowError(f"missing field '{field}' (empty)")
    return text


def _problem_id(row: Mapping[str, Any], where: str) -> str:
    if row.get("id") is not None:
        return str(row["id"])
    extra = row.get("extra_info")
    if isinstance(extra, Mapping) and extra.get("index") is not None:
        return str(extra["index"])
    # Fall back to the position in the file, e.g. "line-3" or "row-17".
    return where.replace(" ", "-")


class PromptSource:
    """Endless, deterministic, epoch-wise shuffled stream of problems.

    Each epoch visits every problem once, in an order that depends only on
    ``(seed, epoch)``. Iteration yields ``(epoch, index, problem)`` where
    ``index`` is the problem's position in the original list, so it is stable
    across epochs.
    """

    def __init__(self, problems: list[Problem], seed: int = 0, shuffle: bool = True) -> None:
        """Initializes the source at epoch 0, position 0.

        Args:
            problems: Problems to cycle through; must be non-empty.
            seed: Shuffle seed.
            shuffle: If False, every epoch visits problems in list order.

        Raises:
            ValueError: If ``problems`` is empty.
        """
        if not problems:
            raise ValueError("PromptSource needs at least one problem")
        self._problems = list(problems)
        self._seed = int(seed)
        self._shuffle = shuffle
        self._epoch = 0
        self._position = 0
        self._order = self._epoch_order(0)

    def __len__(self) -> int:
        return len(self._problems)

    def __iter__(self) -> Iterator[tuple[int, int, Problem]]:
        return self

    def __next__(self) -> tuple[int, int, Problem]:
        if self._position >= len(self._order):
            self._epoch += 1
            self._position = 0
            self._order = self._epoch_order(self._epoch)
        index = self._order[self._position]
        self._position += 1
        return self._epoch, index, self._problems[index]

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self._problems)))
        if self._shuffle:
            # A string seed is hashed with SHA-512, so it is stable across
            # processes regardless of PYTHONHASHSEED.
            random.Random(f"{self._seed}:{epoch}").shuffle(order)
        return order

    def state(self) -> dict[str, int]:
        """Returns the resume point: the next item ``__next__`` will yield."""
        return {
            "seed": self._seed,
            "epoch": self._epoch,
            "position": self._position,
            "num_problems": len(self._problems),
        }

    def load_state(self, state: Mapping[str, int]) -> None:
        """Restores a point saved by :meth:`state`.

        Args:
            state: A dict returned by :meth:`state`.

        Raises:
            ValueError: If the state belongs to a different seed or dataset
                size, or its position is out of range.
        """
        if int(state["num_problems"]) != len(self._problems):
            raise ValueError(f"state is for {state['num_problems']} problems, this source has {len(self._problems)}")
        if int(state["seed"]) != self._seed:
            raise ValueError(f"state is for seed {state['seed']}, this source uses {self._seed}")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self._problems):
            raise ValueError(f"invalid state: epoch={epoch}, position={position}")
        self._epoch = epoch
        self._position = position
        self._order = self._epoch_order(epoch)


def render_prompt(tokenizer: Any, messages: list[dict], chat_template_kwargs: dict | None = None) -> list[int]:
    """Tokenizes chat messages with the tokenizer's chat template.

    Args:
        tokenizer: A Hugging Face tokenizer with a chat template.
        messages: Chat messages, e.g. ``Problem.messages``.
        chat_template_kwargs: Extra variables for the template, such as
            ``reasoning_effort`` or ``enable_thinking``.

    Returns:
        Prompt token ids, ending with the generation prompt.

    Raises:
        ValueError: If the tokenizer has no chat template, or the kwargs try to
            override ``add_generation_prompt`` or ``tokenize``.
    """
    kwargs = dict(chat_template_kwargs or {})
    clashing = [k for k in _RESERVED_TEMPLATE_KWARGS if k in kwargs]
    if clashing:
        raise ValueError(f"chat_template_kwargs may not set {clashing}")
    if getattr(tokenizer, "chat_template", None) is None:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(f"tokenizer {name!r} has no chat template; set tokenizer.chat_template")
    result = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    # transformers >= 5 returns a BatchEncoding; older versions a list of ids.
    if isinstance(result, Mapping):
        result = result["input_ids"]
    if result and isinstance(result[0], list):
        result = result[0]
    return [int(t) for t in result]
