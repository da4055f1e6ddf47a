"""Built-in synthetic tasks with verifiable rewards, for the demo and the tests.

``echo``: the prompt is ``<bos>`` and a few random digits; the answer repeats the prompt's last digit
in every response position. Reward = fraction of the ``max_tokens`` response positions holding that
digit, in [0, 1]. A random policy scores about 1/64; learning it needs the policy to condition on the
prompt, which a tiny model picks up within a few dozen GRPO steps.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from modeling.tiny_model import BOS_ID, DIGIT_IDS


@dataclass(frozen=True)
class TaskPrompt:
    prompt_id: str
    prompt_token_ids: list[int]
    target_token_id: int
    data_source: str


class EchoTask:
    """Deterministic stream of echo prompts (seeded) and their reward."""

    name = "echo"

    def __init__(self, seed: int = 0, num_digits: int = 3, max_tokens: int = 8):
        self._rng = random.Random(seed)
        self.num_digits = num_digits
        self.max_tokens = max_tokens
        self._count = 0

    def next_prompt(self) -> TaskPrompt:
        digits = [self._rng.choice(DIGIT_IDS) for _ in range(self.num_digits)]
        self._count += 1
        return TaskPrompt(f"echo-{self._count}", [BOS_ID, *digits], digits[-1], self.name)

    def reward(self, prompt: TaskPrompt, response_token_ids: list[int]) -> float:
        hits = sum(1 for token in response_token_ids[: self.max_tokens] if token == prompt.target_token_id)
        return hits / self.max_tokens
