"""A multi-turn "calculator" agent on fleetrl's agent API, written against the SDK only (fleetrl.agent).

    FLEETRL_TOKEN=... python examples/calculator_agent.py --address HOST:PORT --token-env FLEETRL_TOKEN \
        --sessions 64 --group-size 4 --concurrency 8 [--max-turns 3]

What it assumes of the run: the coordinator serves the agent API (``agent.enabled``), the token has the
``generate`` and ``submit`` scopes, and the policy is fleetrl's tiny "echo" model (modeling/tiny_model.py), whose
vocabulary is ``<pad> <bos> <eos>`` then the characters ``0-9 a-z space = + - * / : , . ? ! ( )`` (ids 0..51 of
64). The constants below restate those ids: examples import nothing of fleetrl but the SDK and protos.

The task, honestly stated: the model cannot do arithmetic, so the "calculator" is a toy shaped so that the CPU
demo's echo skill transfers and reward can rise on CPU.

1. Prompt: ``<bos>`` and three random digits d1 d2 d3, the demo's echo prompt (the number n = d1d2d3).
2. The model generates a turn. A turn holding any digit counts as a calculator call (the model asks for n).
3. The tool evaluates the trivial expression ``n * 1`` and its result is appended as tool tokens (trained with
   mask 0): ``=`` then the digits of the result, i.e. ``= d1 d2 d3``. The model generates again; at most
   ``--max-turns`` generated turns in all.
4. Reward of the session = the demo's echo reward (coordinator/tasks.py EchoTask, re-implemented here) on the
   final generated turn: the fraction of its ``--max-tokens`` positions holding the last digit of the last
   number in the context (d3; the tool result ends with it too). A random policy scores about 1/64.

Each task opens ``--group-size`` sessions of the same prompt (group_key = the task id, one GRPO group), so the
run's advantage compares them. Progress goes to stderr; the last line on stdout is a JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import sys
import uuid
from dataclasses import dataclass, field

from fleetrl.agent import (
    AgentError,
    AsyncAgentClient,
    AsyncSession,
    GroupState,
    PermissionDenied,
    RetryPolicy,
    SessionLost,
    StreamInterrupted,
    Unauthenticated,
    Unavailable,
)

logger = logging.getLogger("calculator_agent")

# The tiny echo model's vocabulary (modeling/tiny_model.py): specials, then one id per character.
BOS_ID, EOS_ID = 1, 2
DIGIT_IDS = list(range(3, 13))  # '0'..'9'
EQUALS_ID = 3 + 10 + 26 + 1  # '=' follows the digits, the letters and the space
NUM_PROMPT_DIGITS = 3
SESSION_ATTEMPTS = 2  # a session lost mid-way is abandoned (its slot freed) and retried in the same group


def calculator_call(turn_token_ids: list[int]) -> bool:
    """A turn holding a digit asks the calculator for the prompt's number."""
    return any(token in DIGIT_IDS for token in turn_token_ids)


def calculator_result(prompt_token_ids: list[int]) -> list[int]:
    """``= `` and the digits of ``n * 1``, n being the prompt's number, as tool tokens."""
    digits = "".join(str(DIGIT_IDS.index(t)) for t in prompt_token_ids if t in DIGIT_IDS)
    result = int(digits) * 1
    return [EQUALS_ID, *(DIGIT_IDS[int(c)] for c in str(result).zfill(len(digits)))]


def echo_reward(context_token_ids: list[int], turn_token_ids: list[int], max_tokens: int) -> float:
    """The demo's echo reward: the fraction of the turn's ``max_tokens`` positions holding the last digit of the
    context before the turn (coordinator/tasks.py EchoTask.reward)."""
    target = next(t for t in reversed(context_token_ids) if t in DIGIT_IDS)
    return sum(1 for token in turn_token_ids[:max_tokens] if token == target) / max_tokens


@dataclass
class Totals:
    sessions_submitted: int = 0
    sessions_failed: int = 0
    groups_queued: int = 0
    groups_skipped: int = 0  # all rewards equal: dropped by the run's dynamic sampling (coordinator.dynamic_sampling)
    rewards: list[float] = field(default_factory=list)


async def run_session(session: AsyncSession, args) -> float:
    """Generate, call the calculator while the model asks and turns remain, score the final turn; submit."""
    for turn_number in range(1, args.max_turns + 1):
        context = session.token_ids
        turn = await session.generate(args.max_tokens, stop_token_ids=[EOS_ID])
        if turn_number == args.max_turns or not calculator_call(turn.token_ids):
            break
        await session.append(calculator_result(session.prompt_token_ids))
    return echo_reward(context, turn.token_ids, args.max_tokens)


async def run_group_member(client, task_id: str, prompt: list[int], args, totals: Totals) -> float | None:
    """One session of the task's group; its reward, None when every attempt failed."""
    for attempt in range(1, SESSION_ATTEMPTS + 1):
        try:
            async with client.session(
                prompt, group_key=task_id, group_size=args.group_size, metadata={"task_id": task_id}
            ) as session:
                reward = await run_session(session, args)
                result = await session.submit(reward=reward)
        except (SessionLost, StreamInterrupted, Unavailable) as err:
            logger.warning("%s: session attempt %d/%d failed: %s", task_id, attempt, SESSION_ATTEMPTS, err)
            continue
        totals.sessions_submitted += 1
        totals.rewards.append(reward)
        if result.group_state in (GroupState.QUEUED, GroupState.ACCEPTED):  # complete: this agent is done with it
            totals.groups_queued += 1
        elif result.group_state is GroupState.SKIPPED:
            totals.groups_skipped += 1
        return reward
    totals.sessions_failed += 1
    return None


async def run_task(client, index: int, args, totals: Totals, limit: asyncio.Semaphore, rng: random.Random) -> None:
    """One task: its group's sessions run together once the task gets a group slot (``limit``).

    Whole groups take the slots, never single sessions: the server queues groups in admission order, so a
    half-started group waiting for slots held by later groups would stall them all.
    """
    task_id = f"calc-{args.run_tag}-{index}"
    prompt = [BOS_ID, *(rng.choice(DIGIT_IDS) for _ in range(NUM_PROMPT_DIGITS))]
    async with limit:
        members = (run_group_member(client, task_id, prompt, args, totals) for _ in range(args.group_size))
        rewards = [r for r in await asyncio.gather(*members) if r is not None]
    mean = sum(totals.rewards) / max(1, len(totals.rewards))
    print(
        f"{task_id}: {len(rewards)}/{args.group_size} submitted, rewards {[round(r, 3) for r in rewards]}, "
        f"run mean {mean:.3f}, groups queued {totals.groups_queued}",
        file=sys.stderr,
        flush=True,
    )


async def main_async(args) -> dict:
    token = os.environ.get(args.token_env, "")
    if not token:
        raise SystemExit(f"--token-env {args.token_env}: the environment variable is empty or unset")
    totals, rng = Totals(), random.Random(args.seed)
    limit = asyncio.Semaphore(max(1, args.concurrency // args.group_size))  # groups in flight
    retry = RetryPolicy(admission_timeout_s=args.admission_timeout_s)
    async with AsyncAgentClient(args.address, token, tls_ca_file=args.tls_ca_file, retry=retry) as client:
        num_tasks = args.sessions // args.group_size
        try:
            await asyncio.gather(*(run_task(client, i, args, totals, limit, rng) for i in range(num_tasks)))
        except (Unauthenticated, PermissionDenied) as err:
            raise SystemExit(f"the agent API refused the token: {err}") from err
        except AgentError as err:
            logger.error("run stopped: %s", err)
            raise
    return {
        "sessions_submitted": totals.sessions_submitted,
        "sessions_failed": totals.sessions_failed,
        "mean_reward": sum(totals.rewards) / max(1, len(totals.rewards)),
        "groups_queued": totals.groups_queued,
        "groups_skipped": totals.groups_skipped,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", required=True, help="host:port of the coordinator's agent API")
    parser.add_argument("--token-env", default="FLEETRL_TOKEN", help="environment variable holding the token")
    parser.add_argument("--tls-ca-file", default=None, help="PEM bundle of the server's CA (TLS); unset = plaintext")
    parser.add_argument("--sessions", type=int, required=True, help="sessions in all (a multiple of --group-size)")
    parser.add_argument("--group-size", type=int, default=4, help="sessions per task (one GRPO group)")
    parser.add_argument(
        "--concurrency", type=int, default=8, help="sessions in flight at most (whole groups: max(1, C // G) at a time)"
    )
    parser.add_argument("--max-turns", type=int, default=3, help="generated turns per session at most")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per generated turn (the reward's length)")
    parser.add_argument("--admission-timeout-s", type=float, default=300.0, help="longest wait to open a session")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    parser.add_argument("--run-tag", default=uuid.uuid4().hex[:8], help="makes this run's group keys unique")
    args = parser.parse_args(argv)
    if args.sessions < args.group_size or args.sessions % args.group_size:
        parser.error(f"--sessions {args.sessions} must be a positive multiple of --group-size {args.group_size}")
    if min(args.group_size, args.concurrency, args.max_turns, args.max_tokens) < 1:
        parser.error("--group-size, --concurrency, --max-turns and --max-tokens must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    summary = asyncio.run(main_async(parse_args(argv)))
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
