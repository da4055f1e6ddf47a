"""Tasks: where prompts come from and how responses are scored (``PromptSource -> ... -> RewardFn``).

``echo`` (built in, for the demo and the tests): the prompt is ``<bos>`` and a few random digits; the
answer repeats the prompt's last digit in every response position. Reward = fraction of the
``max_tokens`` response positions holding that digit, in [0, 1]. A random policy scores about 1/64;
learning it needs the policy to condition on the prompt, which a tiny model picks up within a few
dozen GRPO steps.

A dataset path (``.jsonl``/``.parquet``, verl/DAPO or plain schema): prompts are rendered with the
tokenizer's chat template (plus ``chat_template_kwargs``), responses are decoded and scored by a
reward function (built-in ``math`` or a ``module:function`` plug-in, sync or async, run off the event
loop), with DAPO's overlong penalty when configured.
"""

from __future__ import annotations

import functools
import logging
import random
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from coordinator.datasets import DEFAULT_PROMPT_TEMPLATE, Problem, PromptSource, load_dataset, render_prompt
from coordinator.rewards import RewardFn, RewardResult, get_reward_fn, overlong_penalty_reward, score_group
from modeling.tiny_model import BOS_ID, DIGIT_IDS
from protos.config import CoordinatorConfig

logger = logging.getLogger(__name__)

DATASET_SUFFIXES = (".jsonl", ".parquet")
MAX_ECHO_PROMPT = 100_000  # <name>-<n> of a seeded task is found by replaying n draws: ids stay cheap up to here


@dataclass(frozen=True)
class TaskPrompt:
    prompt_id: str
    prompt_token_ids: list[int]
    data_source: str
    payload: Any  # echo: the target token id; tail: (length, digit); datasets: the Problem
    max_tokens: int = 0  # this prompt's own response limit (the tail task's); 0 = the run's sampling.max_tokens


class Task(Protocol):
    name: str

    def next_prompt(self) -> TaskPrompt: ...

    def cursor(self) -> dict[str, int]:
        """The stream position: ``restore`` of it makes ``next_prompt`` continue from here."""
        ...

    def restore(self, cursor: dict[str, int]) -> None:
        """Continue from a ``cursor()``; ValueError when it belongs to another seed or dataset."""
        ...

    async def score(self, prompt: TaskPrompt, responses: list[list[int]]) -> list[RewardResult]: ...

    def prompt_by_id(self, prompt_id: str) -> TaskPrompt:
        """A prompt of the task by its id (an external agent's task_id); ValueError naming the id when unknown."""
        ...


class SeededStream:
    """A built-in task whose prompts come from one seeded generator: the cursor is the number of draws, ``restore``
    replays them (the only way to the generator's state), and ``<name>-<n>`` names the n-th draw."""

    name: str

    def __init__(self, seed: int):
        self.seed = seed
        self._rng = random.Random(seed)
        self._count = 0

    def cursor(self) -> dict[str, int]:
        return {"seed": self.seed, "draws": self._count}

    def restore(self, cursor: dict[str, int]) -> None:
        if cursor.get("seed") != self.seed:
            raise ValueError(f"the cursor is for {self.name} seed {cursor.get('seed')}, this task has seed {self.seed}")
        self._rng, self._count = random.Random(self.seed), 0
        for _ in range(cursor["draws"]):
            self.next_prompt()

    def next_prompt(self) -> TaskPrompt:
        raise NotImplementedError

    def draw_number(self, prompt_id: str) -> int:
        """n of ``<name>-<n>`` (1 <= n <= MAX_ECHO_PROMPT); ValueError naming the id otherwise."""
        name, _, number = prompt_id.partition("-")
        if name != self.name or not number.isdigit() or not 1 <= int(number) <= MAX_ECHO_PROMPT:
            raise ValueError(
                f"{prompt_id!r} is no {self.name} prompt id: '{self.name}-<n>' with 1 <= n <= {MAX_ECHO_PROMPT}"
            )
        return int(number)


class EchoTask(SeededStream):
    """Deterministic stream of echo prompts (seeded) and their reward."""

    name = "echo"

    def __init__(self, seed: int = 0, num_digits: int = 3, max_tokens: int = 8):
        super().__init__(seed)
        self.num_digits = num_digits
        self.max_tokens = max_tokens

    def next_prompt(self) -> TaskPrompt:
        digits = [self._rng.choice(DIGIT_IDS) for _ in range(self.num_digits)]
        self._count += 1
        return TaskPrompt(f"echo-{self._count}", [BOS_ID, *digits], self.name, digits[-1])

    def prompt_by_id(self, prompt_id: str) -> TaskPrompt:
        """``echo-<n>``: the n-th prompt ``next_prompt`` draws from this seed (1 <= n <= MAX_ECHO_PROMPT)."""
        digits = _echo_digits(self.seed, self.num_digits, self.draw_number(prompt_id))
        return TaskPrompt(prompt_id, [BOS_ID, *digits], self.name, digits[-1])

    def reward(self, prompt: TaskPrompt, response_token_ids: list[int]) -> float:
        hits = sum(1 for token in response_token_ids[: self.max_tokens] if token == prompt.payload)
        return hits / self.max_tokens

    async def score(self, prompt: TaskPrompt, responses: list[list[int]]) -> list[RewardResult]:
        return [RewardResult(self.reward(prompt, ids)) for ids in responses]


@functools.lru_cache(maxsize=4096)
def _echo_digits(seed: int, num_digits: int, number: int) -> tuple[int, ...]:
    rng = random.Random(seed)  # the draws of EchoTask.next_prompt, replayed
    for _ in range(number):
        digits = tuple(rng.choice(DIGIT_IDS) for _ in range(num_digits))
    return digits


class PromptRenderer:
    """Chat messages -> prompt token ids, with the tokenizer's chat template when it has one.

    A tokenizer without a chat template (e.g. a bare character tokenizer) gets a plain fallback:
    BOS, then the message contents joined by blank lines; ``chat_template_kwargs`` then have no effect.
    """

    def __init__(self, tokenizer: Any, chat_template_kwargs: dict[str, Any]):
        self.tokenizer = tokenizer
        self.chat_template_kwargs = chat_template_kwargs
        self.plain = getattr(tokenizer, "chat_template", None) is None
        if self.plain:
            logger.warning(
                "tokenizer %s has no chat template: prompts are rendered plain (BOS + contents)%s",
                getattr(tokenizer, "name_or_path", ""),
                f"; chat_template_kwargs {chat_template_kwargs} are ignored" if chat_template_kwargs else "",
            )

    def render(self, messages: list[dict]) -> list[int]:
        if not self.plain:
            return render_prompt(self.tokenizer, messages, self.chat_template_kwargs)
        text = "\n\n".join(m["content"] for m in messages)
        bos = self.tokenizer.bos_token_id
        return ([bos] if bos is not None else []) + list(self.tokenizer.encode(text, add_special_tokens=False))


class ResponseScorer:
    """Decodes responses and scores them with a reward function in ``executor`` (or awaits it, if async)."""

    def __init__(self, tokenizer: Any, reward_fn: RewardFn, executor: Executor | None, timeout_s: float):
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.executor = executor
        self.timeout_s = timeout_s

    async def score(self, problem: Problem, responses: list[list[int]]) -> list[RewardResult]:
        texts = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
        pairs = [(text, len(ids)) for text, ids in zip(texts, responses, strict=True)]
        return await score_group(self.reward_fn, problem, pairs, self.executor, self.timeout_s)


class DatasetTask:
    """Endless, seeded, epoch-wise shuffled prompts of a dataset file and their rewards.

    Prompts longer than ``max_model_len - sampling.max_tokens`` cannot be served; they are skipped and
    counted in ``prompts_too_long`` (both limits are read live, so a run-time change applies at once).
    """

    def __init__(
        self,
        problems: list[Problem],
        renderer: PromptRenderer,
        scorer: ResponseScorer,
        config: CoordinatorConfig,
        max_model_len: int,
        name: str,
    ):
        self.name = name
        self.source = PromptSource(problems, seed=config.seed)
        self.renderer = renderer
        self.scorer = scorer
        self.config = config
        self.max_model_len = max_model_len
        self.prompts_too_long = 0
        self._rendered: dict[int, list[int]] = {}
        self._problems = problems
        self._index: dict[str, int] = {}  # problem id -> position in the file (the first row of an id)
        for index, problem in enumerate(problems):
            self._index.setdefault(problem.problem_id, index)

    def cursor(self) -> dict[str, int]:
        return self.source.state()

    def restore(self, cursor: dict[str, int]) -> None:
        self.source.load_state(cursor)

    def max_prompt_tokens(self) -> int:
        return self.max_model_len - self.config.sampling.max_tokens

    def next_prompt(self) -> TaskPrompt:
        limit = self.max_prompt_tokens()
        # Two epochs' worth of draws: any window that long holds every problem at least once.
        for _ in range(2 * len(self.source)):
            epoch, index, problem = next(self.source)
            if index not in self._rendered:
                self._rendered[index] = self.renderer.render(problem.messages)
            ids = self._rendered[index]
            if len(ids) <= limit:
                return TaskPrompt(f"{problem.problem_id}-e{epoch}", ids, problem.data_source, problem)
            self.prompts_too_long += 1
        raise ValueError(
            f"no prompt of {self.name} fits in {limit} tokens (rollout.max_model_len {self.max_model_len} - "
            f"coordinator.sampling.max_tokens {self.config.sampling.max_tokens}); raise the one or lower the other"
        )

    def prompt_by_id(self, prompt_id: str) -> TaskPrompt:
        """The problem whose id is ``prompt_id`` (the file's ``id`` column, or the loader's row id)."""
        index = self._index.get(prompt_id)
        if index is None:
            raise ValueError(f"no problem {prompt_id!r} in {self.name} ({len(self._problems)} problems)")
        problem = self._problems[index]
        if index not in self._rendered:
            self._rendered[index] = self.renderer.render(problem.messages)
        ids = self._rendered[index]
        if len(ids) > self.max_prompt_tokens():
            raise ValueError(f"problem {prompt_id!r} has {len(ids)} prompt tokens, more than the run serves")
        return TaskPrompt(prompt_id, ids, problem.data_source, problem)

    async def score(self, prompt: TaskPrompt, responses: list[list[int]]) -> list[RewardResult]:
        results = await self.scorer.score(prompt.payload, responses)
        overlong = self.config.overlong
        if not overlong.enabled:
            return results
        max_tokens = self.config.sampling.max_tokens
        return [
            RewardResult(
                overlong_penalty_reward(
                    r.reward, len(ids), max_tokens, min(overlong.buffer_len, max_tokens), overlong.penalty_factor
                ),
                r.error,
            )
            for r, ids in zip(results, responses, strict=True)
        ]


def is_dataset_path(task: str) -> bool:
    return Path(task).suffix.lower() in DATASET_SUFFIXES


def load_tokenizer(model_path: str) -> Any:
    if not model_path:
        raise ValueError("a dataset task needs the model's tokenizer: set model_path (or pass --model DIR)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def load_problems(path: str, config: CoordinatorConfig, limit: int | None) -> list[Problem]:
    return load_dataset(
        path,
        name=Path(path).stem,
        prompt_template=config.prompt_template or DEFAULT_PROMPT_TEMPLATE,
        limit=limit,
        template_chat_prompts=config.template_chat_prompts,
    )


def build_task(config: CoordinatorConfig, max_model_len: int, tokenizer: Any, executor: Executor | None) -> Task:
    """The task named by ``config.task``: 'echo', 'tail' or a dataset file scored by ``config.reward_fn``."""
    if config.task == "echo":
        return EchoTask(seed=config.seed, max_tokens=config.sampling.max_tokens)
    if config.task == "tail":
        from coordinator.tail_task import TailTask  # it builds on this module's TaskPrompt

        return TailTask(seed=config.seed, min_tokens=config.tail_min_tokens, max_tokens=config.sampling.max_tokens)
    if not is_dataset_path(config.task):
        raise ValueError(f"coordinator.task {config.task!r}: expected 'echo', 'tail' or a .jsonl/.parquet dataset path")
    problems = load_problems(config.task, config, config.dataset_limit)
    scorer = ResponseScorer(tokenizer, get_reward_fn(config.reward_fn), executor, config.reward_timeout_s)
    renderer = PromptRenderer(tokenizer, config.template_kwargs())
    task = DatasetTask(problems, renderer, scorer, config, max_model_len, Path(config.task).stem)
    logger.info("task %s: %d problems from %s, reward %s", task.name, len(problems), config.task, config.reward_fn)
    return task
