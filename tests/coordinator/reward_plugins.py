"""Reward plug-ins the coordinator tests load by spec ('tests.coordinator.reward_plugins:NAME')."""

from __future__ import annotations

import asyncio
import zlib


async def parity_of_text(problem, response_text: str, response_len: int) -> float:
    """Async plug-in: 1.0 when the response's crc32 is even. Deterministic per response, and a group of
    n different responses has equal rewards with probability 2^(1-n), so dynamic sampling has work."""
    await asyncio.sleep(0)  # a yield, not a wait: it suspends once, as a plug-in that does I/O would
    return float(zlib.crc32(response_text.encode()) % 2 == 0)


def always_one(problem, response_text: str, response_len: int) -> float:
    """Sync plug-in: every response is correct (eval accuracy and pass@k are then exactly 1)."""
    return 1.0


def zero_for_even_ids(problem, response_text: str, response_len: int) -> float:
    """Sync plug-in: problems with an even id digit always score 0 (their groups are uniform, so dynamic
    sampling must skip them); the others score the response's crc32 parity."""
    if int(problem.problem_id[-1]) % 2 == 0:
        return 0.0
    return float(zlib.crc32(response_text.encode()) % 2 == 0)
