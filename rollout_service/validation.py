"""Ingress validation of Generate requests: every bad field becomes a ValueError naming it."""

from __future__ import annotations

from protos import rollout_pb2 as pb
from rollout_service.engine import SamplingRequest

MAX_REQUEST_ID_LEN = 256


def validate_generate(
    request: pb.GenerateRequest, vocab_size: int, max_model_len: int, max_samples: int
) -> SamplingRequest:
    """Check a GenerateRequest against the engine's limits and return the engine-side request."""
    prompt = list(request.prompt_token_ids)
    s = request.sampling
    if not prompt:
        raise ValueError("prompt_token_ids is empty")
    bad = [t for t in prompt if t < 0 or t >= vocab_size]
    if bad:
        raise ValueError(f"prompt_token_ids holds ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    n = s.n if s.n else 1
    if n > max_samples:
        raise ValueError(f"sampling.n={n} exceeds the server limit {max_samples}")
    if s.max_tokens <= 0:
        raise ValueError(f"sampling.max_tokens must be > 0 (got {s.max_tokens})")
    if len(prompt) + s.max_tokens > max_model_len:
        raise ValueError(
            f"prompt ({len(prompt)} tokens) + sampling.max_tokens ({s.max_tokens}) exceeds the model "
            f"length {max_model_len}"
        )
    if not s.temperature >= 0.0:  # also rejects NaN
        raise ValueError(f"sampling.temperature must be >= 0 (got {s.temperature})")
    if n > 1 and s.temperature == 0.0:
        raise ValueError(f"sampling.n={n} needs sampling.temperature > 0 (greedy samples would be identical)")
    top_p = s.top_p if s.top_p != 0.0 else 1.0
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"sampling.top_p must be in (0, 1] (got {s.top_p})")
    if s.top_k < -1:
        raise ValueError(f"sampling.top_k must be -1, 0 (off) or positive (got {s.top_k})")
    if not 0.0 <= s.min_p <= 1.0:
        raise ValueError(f"sampling.min_p must be in [0, 1] (got {s.min_p})")
    if not 0 <= s.logprobs <= 20:
        raise ValueError(f"sampling.logprobs must be in [0, 20] (got {s.logprobs})")
    bad_stop = [t for t in s.stop_token_ids if t < 0 or t >= vocab_size]
    if bad_stop:
        raise ValueError(f"sampling.stop_token_ids outside the vocabulary: {bad_stop[:5]}")
    if s.stream_interval > max_model_len:
        raise ValueError(f"sampling.stream_interval must be in [0, {max_model_len}] (got {s.stream_interval})")
    if len(request.request_id) > MAX_REQUEST_ID_LEN:
        raise ValueError(f"request_id is longer than {MAX_REQUEST_ID_LEN} characters")
    return SamplingRequest(
        prompt_token_ids=prompt,
        n=n,
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        stop_token_ids=list(s.stop_token_ids),
        seed=s.seed if s.HasField("seed") else None,
        logprobs=s.logprobs,
        ignore_eos=s.ignore_eos,
        request_id=request.request_id,
        priority=request.priority,
        stream_interval=s.stream_interval,
    )
