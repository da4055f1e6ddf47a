"""``tail``: a built-in task whose response lengths follow a long tail, for what asynchrony buys on such work.

The prompt is ``<bos>``, the length ``n`` written in digits, ``:`` and one target digit; the answer is that digit
``n`` times, then ``<eos>``. ``n`` is drawn log-uniformly from [``min_tokens``, ``max_tokens``]: most responses are
short and a few are many times longer (p99 / p50 = (max / min) ** 0.49; 1..96 gives ~9). Each request may generate
``n + 1`` tokens (the digits and the stop), so a response is never longer than its prompt asks for and the lengths
follow the draw whatever the policy does: a synchronous step waits for its longest response while an asynchronous
pipeline fills that wait with the next step's work.

Reward, in [0, 1]: 0.9 x the fraction of the first ``n`` positions holding the digit, plus 0.1 for stopping right
(``<eos>`` right after the ``n``-th token). Echoing the digit is what a tiny model learns within a few dozen steps;
stopping at the right length asks it to count, which it learns slowly, if at all.
"""

from __future__ import annotations

import functools
import math
import random

from coordinator.rewards import RewardResult
from coordinator.tasks import SeededStream, TaskPrompt
from modeling.tiny_model import BOS_ID, DIGIT_IDS, EOS_ID, vocab

STOP_BONUS = 0.1  # the reward's part for stopping at the right length; the rest is per correct position
_COLON_ID = vocab()[":"]


def draw_length(rng: random.Random, min_tokens: int, max_tokens: int) -> int:
    """A response length, log-uniform on [min_tokens, max_tokens] (integers, both ends included)."""
    low, high = math.log(min_tokens), math.log(max_tokens + 1)
    return min(max_tokens, int(math.exp(rng.uniform(low, high))))


def _draw(rng: random.Random, min_tokens: int, max_tokens: int) -> tuple[int, int]:
    """One prompt's (length, digit)."""
    return draw_length(rng, min_tokens, max_tokens), rng.choice(DIGIT_IDS)


class TailTask(SeededStream):
    """Seeded stream of long-tailed echo prompts and their reward (the ``Task`` protocol of coordinator/tasks.py)."""

    name = "tail"

    def __init__(self, seed: int = 0, min_tokens: int = 1, max_tokens: int = 96):
        if not 1 <= min_tokens <= max_tokens:
            raise ValueError(
                f"coordinator.tail_min_tokens {min_tokens} must be >= 1 and <= coordinator.sampling.max_tokens "
                f"{max_tokens} (the longest response the tail task asks for)"
            )
        if max_tokens + 1 > 10**4:  # the prompt's length digits stay short
            raise ValueError(f"coordinator.sampling.max_tokens {max_tokens}: the tail task asks for at most 9999")
        super().__init__(seed)
        self.min_tokens = min_tokens
        self.max_tokens = max_tokens

    def next_prompt(self) -> TaskPrompt:
        self._count += 1
        return self._prompt(self._count, *_draw(self._rng, self.min_tokens, self.max_tokens))

    def prompt_by_id(self, prompt_id: str) -> TaskPrompt:
        """``tail-<n>``: the n-th prompt ``next_prompt`` draws from this seed."""
        number = self.draw_number(prompt_id)
        return self._prompt(number, *_tail_draw(self.seed, self.min_tokens, self.max_tokens, number))

    def _prompt(self, number: int, length: int, digit: int) -> TaskPrompt:
        length_ids = [DIGIT_IDS[int(c)] for c in str(length)]
        ids = [BOS_ID, *length_ids, _COLON_ID, digit]
        return TaskPrompt(f"tail-{number}", ids, self.name, (length, digit), max_tokens=length + 1)

    def reward(self, prompt: TaskPrompt, response_token_ids: list[int]) -> float:
        length, digit = prompt.payload
        hits = sum(1 for token in response_token_ids[:length] if token == digit)
        stopped = len(response_token_ids) == length + 1 and response_token_ids[length] == EOS_ID
        return (1 - STOP_BONUS) * hits / length + (STOP_BONUS if stopped else 0.0)

    async def score(self, prompt: TaskPrompt, responses: list[list[int]]) -> list[RewardResult]:
        return [RewardResult(self.reward(prompt, ids)) for ids in responses]


@functools.lru_cache(maxsize=4096)
def _tail_draw(seed: int, min_tokens: int, max_tokens: int, number: int) -> tuple[int, int]:
    rng = random.Random(seed)  # the draws of TailTask.next_prompt, replayed
    for _ in range(number):
        draw = _draw(rng, min_tokens, max_tokens)
    return draw
