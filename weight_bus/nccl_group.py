"""The pure side of the NCCL weight broadcast: broadcast plans, timeout and rebuild rules (the Redis records they
follow are channels/nccl_board.py's).

No cupy and no CUDA here, so all of it runs and is tested on CPU; ``weight_bus.nccl`` holds the thin
GPU layer that follows these decisions.

Protocol (trainer = rank 0 and the only sender; each rollout GPU process = one subscriber rank):

1. Subscribers heartbeat an ``NcclMember`` record into the hash ``members`` (every ``HEARTBEAT_S``).
2. Before a round, the publisher compares the alive members with the current ``NcclGroup``. If they
   differ (a join, a death) it writes a new group: generation + 1, a fresh NCCL unique id, members in
   rank order. Subscribers see the generation change, abort their old communicator and join.
3. Per version the publisher writes an ``NcclRound`` (generation, version, bucket sizes, buffer size):
   every rank derives the same list of broadcasts from it with ``plan_chunks``.
4. Every broadcast has a deadline. On a timeout or an NCCL error the publisher aborts its communicator,
   drops the members whose heartbeat is stale (``members_to_keep``), writes the next generation and
   re-broadcasts the version to the survivors, who then commit it. Versions are all or nothing per
   subscriber: the manifest (with checksums) is announced only after the bytes went out.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from protos.records import NcclGroup, NcclMember

HEARTBEAT_S = 1.0
NCCL_SUCCESS = 0
NCCL_IN_PROGRESS = 7  # ncclInProgress: a non-blocking call or init still running


# ------------------------------------------------------------------------------------------------
# plans and decisions (pure)


@dataclass(frozen=True)
class Chunk:
    """One broadcast: ``nbytes`` of bucket ``bucket`` from ``start``; ``offset`` in the end-to-end buffer."""

    bucket: int
    start: int
    nbytes: int
    offset: int


def plan_chunks(bucket_nbytes: list[int], buffer_nbytes: int) -> list[Chunk]:
    """Split buckets into broadcasts that fit one device buffer (a bucket holding one huge tensor is split)."""
    if buffer_nbytes <= 0:
        raise ValueError(f"buffer_nbytes must be positive, got {buffer_nbytes}")
    chunks, offset = [], 0
    for bucket, size in enumerate(bucket_nbytes):
        for start in range(0, size, buffer_nbytes):
            nbytes = min(buffer_nbytes, size - start)
            chunks.append(Chunk(bucket, start, nbytes, offset + start))
        offset += size
    return chunks


def alive_members(heartbeats: dict[str, NcclMember], now: float, timeout_s: float) -> list[str]:
    """Members whose process and receive loop both beat within ``timeout_s``, in a stable (sorted) order.

    A subscriber that lives but does not poll its receive loop would stall every broadcast, so it
    counts as gone until it polls again (it rejoins at the next round boundary).
    """
    return sorted(m for m, beat in heartbeats.items() if beat.is_alive(now, timeout_s))


def needs_new_group(group: NcclGroup | None, alive: list[str]) -> bool:
    """A new generation is needed when membership changed (joins happen at round boundaries)."""
    return group is None or sorted(group.members) != sorted(alive)


def members_to_keep(
    group: NcclGroup, heartbeats: dict[str, NcclMember], now: float, timeout_s: float
) -> tuple[list[str], list[str]]:
    """After a failed broadcast: (keep, drop). Dropped are members whose heartbeat is stale or missing.

    A broadcast stalls every rank behind a dead one, so the stall itself does not say who is dead;
    the heartbeat does (``progress_s`` comes from the loop that drives a subscriber's broadcasts).
    """
    alive = set(alive_members(heartbeats, now, timeout_s))
    keep = [m for m in group.members if m in alive]
    drop = [m for m in group.members if m not in alive]
    return keep, drop


def next_group(previous: NcclGroup | None, members: list[str], unique_id: bytes, now: float) -> NcclGroup:
    generation = previous.generation + 1 if previous is not None else 1
    return NcclGroup(generation, unique_id, list(members), now)


class Outcome(enum.Enum):
    DONE = "done"
    WAIT = "wait"
    FAILED = "failed"  # NCCL reported an error (a peer died, the network broke)
    TIMED_OUT = "timed_out"  # no completion within the deadline (a peer stalls)
    SUPERSEDED = "superseded"  # subscriber: the publisher moved to a newer generation


def watch_outcome(
    done: bool, async_error: int, now: float, deadline: float, generation: int = 0, current_generation: int = 0
) -> Outcome:
    """What a rank does next while a broadcast (or a non-blocking init) is in flight."""
    if async_error not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
        return Outcome.FAILED
    if done:  # the broadcast's completion event fired: its bytes are in place
        return Outcome.DONE
    if current_generation > generation:
        return Outcome.SUPERSEDED
    if now >= deadline:
        return Outcome.TIMED_OUT
    return Outcome.WAIT


def wait_for(read, accept, timeout_s: float, what: str, poll_s: float = 0.05):
    """Poll ``read()`` until ``accept(value)``; TimeoutError names ``what`` it waited for."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if value is not None and accept(value):
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"weight bus (nccl): waited {timeout_s:.1f}s for {what}")
        time.sleep(poll_s)
