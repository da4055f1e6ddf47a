"""The chaos soak's fault schedule: which faults, against what, at which point of the run, from one seed.

A fault is due once the trainer has reported ``after_step`` (a point of the run, not a wall time: the machine's speed
varies) and ``delay_s`` more seconds have passed. The schedule is a pure function of its seed and sizes, so a failing
soak is rerun as it was by its seed (the test id and the report name it).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

KILL_ROLLOUT = "kill_rollout"  # SIGKILL of a rollout server's process group (its vLLM engine core too)
KILL_TRAINER = "kill_trainer"
KILL_COORDINATOR = "kill_coordinator"
REDIS_RESTART = "redis_restart"  # SIGKILL valkey, start it again on the same port and data dir (AOF, fsync always)
CONNECTION_CUT = "connection_cut"  # the fault proxy closes every Redis connection and refuses new ones a while

# About one step of the soak's run on 2 cores (0.1-0.3 s): a fault lands at a random point inside its step. Seconds
# more would let a fast run outpace the schedule (each fault waits for the one before to recover), and its last
# faults would land after the last step.
STEP_S = 0.3

KINDS = (KILL_ROLLOUT, KILL_TRAINER, KILL_COORDINATOR, REDIS_RESTART, CONNECTION_CUT)
# kills are restarted by the launcher; the rest are outages the roles ride out through channels/retry.py
ROLE_OF_KILL = {KILL_TRAINER: "trainer", KILL_COORDINATOR: "coordinator"}


@dataclass(frozen=True)
class Fault:
    """One scheduled fault."""

    kind: str  # one of KINDS
    target: str  # the role killed (rollout-1, trainer, coordinator), or "redis" / "proxy"
    after_step: int  # due once the trainer reported this step ...
    delay_s: float  # ... and this much later (a random point inside the step)
    duration_s: float  # how long an outage lasts (a cut, valkey being down); 0 for a kill


@dataclass(frozen=True)
class SoakSize:
    """How long a soak runs and how many faults of each kind it injects."""

    num_steps: int
    faults_per_kind: dict[str, int]
    first_step: int = 2  # no fault before the run has trained this many steps (start-up is not the soak)
    last_steps_free: int = 6  # the last steps are left alone: every fault's recovery shows within the run

    def __post_init__(self) -> None:
        unknown = set(self.faults_per_kind) - set(KINDS)
        if unknown:
            raise ValueError(f"faults_per_kind: unknown fault kinds {sorted(unknown)}; known: {KINDS}")
        if (self.num_steps - self.last_steps_free) // 2 < self.first_step:
            raise ValueError(
                f"num_steps={self.num_steps} leaves no step for faults between first_step={self.first_step} and "
                f"the last {self.last_steps_free} steps; raise num_steps"
            )


def make_schedule(seed: int, size: SoakSize, num_rollout_servers: int) -> list[Fault]:
    """The faults of a soak, in the order they are due: each kind ``size.faults_per_kind[kind]`` times at random
    steps of ``[first_step, num_steps - last_steps_free]`` (a rollout server's kill in the first half of that: its
    engine's start is the slowest recovery and must show within the run); kills pick a random rollout server,
    outages last 0.5-3 s."""
    if num_rollout_servers < 1:
        raise ValueError(f"num_rollout_servers must be >= 1 (got {num_rollout_servers})")
    rng = random.Random(seed)
    last_step = size.num_steps - size.last_steps_free
    faults = []
    for kind in KINDS:
        for _ in range(size.faults_per_kind.get(kind, 0)):
            if kind == KILL_ROLLOUT:
                target = f"rollout-{rng.randrange(num_rollout_servers)}"
            else:
                target = ROLE_OF_KILL.get(kind, "redis" if kind == REDIS_RESTART else "proxy")
            outage = kind in (REDIS_RESTART, CONNECTION_CUT)
            faults.append(
                Fault(
                    kind=kind,
                    target=target,
                    after_step=rng.randint(size.first_step, last_step // 2 if kind == KILL_ROLLOUT else last_step),
                    delay_s=round(rng.uniform(0.0, STEP_S), 2),
                    duration_s=round(rng.uniform(0.5, 3.0), 2) if outage else 0.0,
                )
            )
    return sorted(faults, key=lambda fault: (fault.after_step, fault.delay_s, fault.kind))


def count_by_kind(faults: list[Fault]) -> dict[str, int]:
    return {kind: sum(1 for fault in faults if fault.kind == kind) for kind in KINDS}


def expected_restarts(faults: list[Fault], role_names: list[str]) -> dict[str, int]:
    """The restarts per role the launcher must report after ``faults``: one per kill of the role, none else."""
    restarts = dict.fromkeys(role_names, 0)
    for fault in faults:
        if fault.kind.startswith("kill_"):
            restarts[fault.target] += 1
    return restarts
