"""The one retry policy of the SDK: which failures are retried, how long the client waits between attempts.

- UNAVAILABLE and DEADLINE_EXCEEDED are retried with bounded exponential backoff, ``max_attempts`` attempts in
  all. Every call is safe to repeat: OpenSession carries one ``open_id`` and Submit one ``submission_id`` for
  all its attempts, Generate and Append carry ``expected_length`` (a repeat of a recorded turn is refused with
  FAILED_PRECONDITION and the session resyncs with GetSession; see ``fleetrl.agent.history``).
- RESOURCE_EXHAUSTED with ``retry-after-ms`` trailing metadata (the staleness budget on OpenSession, the rate
  limit on any call; nothing is written on a refusal) is retried after exactly that delay, until the next wait
  would end past ``admission_timeout_s`` after the first attempt: then OpenSession raises AdmissionTimeout and
  other calls ResourceExhausted. Without the metadata it is raised at once.
- Every other code is raised at once as its typed error (``fleetrl.agent.errors``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from fleetrl.agent.errors import AdmissionTimeout, ResourceExhausted, from_rpc_error, retry_after_s

TRANSIENT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


@dataclass(frozen=True)
class RetryPolicy:
    """How the client retries (see the module docstring for the rules)."""

    max_attempts: int = 5
    """Attempts of one call on UNAVAILABLE / DEADLINE_EXCEEDED, the first included (1 = no retry)."""
    initial_backoff_s: float = 0.1
    """Wait before the first retry."""
    max_backoff_s: float = 2.0
    """Longest wait between two attempts."""
    backoff_multiplier: float = 2.0
    """Each retry waits this many times longer than the one before, up to ``max_backoff_s``."""
    jitter: float = 0.1
    """Each backoff is scaled by a random factor in [1 - jitter, 1 + jitter] (clients retrying together spread)."""
    admission_timeout_s: float = 300.0
    """How long one call keeps honouring ``retry-after-ms`` refusals before it gives up."""

    def __post_init__(self):
        if self.max_attempts < 1:
            raise ValueError(f"RetryPolicy.max_attempts must be >= 1, got {self.max_attempts}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"RetryPolicy.jitter must be in [0, 1), got {self.jitter}")

    def backoff_s(self, retry: int) -> float:
        """The wait before retry number ``retry`` (0-based)."""
        base = min(self.max_backoff_s, self.initial_backoff_s * self.backoff_multiplier**retry)
        return base * random.uniform(1 - self.jitter, 1 + self.jitter)


class CallAttempts:
    """The retry state of one logical call (all its attempts): ``delay_after`` says how long to wait before the
    next attempt or raises the typed error."""

    def __init__(self, policy: RetryPolicy, method: str, clock: Callable[[], float] = time.monotonic):
        self.policy = policy
        self.method = method
        self.retries = 0
        self._clock = clock
        self._admission_deadline = clock() + policy.admission_timeout_s

    @property
    def retried(self) -> bool:
        """Whether an attempt was repeated after a transient failure (its reply may have been lost)."""
        return self.retries > 0

    def delay_after(self, err: grpc.RpcError) -> float:
        """Seconds to wait before the next attempt after ``err``; raises its typed error when there is none."""
        code = err.code()
        if code in TRANSIENT_CODES:
            if self.retries + 1 >= self.policy.max_attempts:
                raise from_rpc_error(err, self.method, f"after {self.retries + 1} attempts") from err
            delay = self.policy.backoff_s(self.retries)
            self.retries += 1
            return delay
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            wait_s = retry_after_s(err)
            if wait_s is None:
                raise from_rpc_error(err, self.method) from err
            if self._clock() + wait_s > self._admission_deadline:
                cls = AdmissionTimeout if self.method == "OpenSession" else ResourceExhausted
                raise cls(
                    f"{self.method}: still refused RESOURCE_EXHAUSTED after admission_timeout_s="
                    f"{self.policy.admission_timeout_s}: {err.details()}",
                    code=code,
                    details=err.details() or "",
                    retry_after_s=wait_s,
                ) from err
            return wait_s
        raise from_rpc_error(err, self.method) from err
