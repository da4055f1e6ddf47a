"""Prometheus metrics of a rollout server, named ``rollout_<thing>_<unit>`` (``rollout/`` in docs)."""

from prometheus_client import Counter, Gauge, Histogram

TOKENS = Counter("rollout_generated_tokens", "Tokens generated (rate() gives tokens/s)")
RUNNING = Gauge("rollout_requests_running", "Generate calls in flight")
REJECTED = Counter("rollout_requests_rejected", "Generate calls rejected (bad input or backpressure)")
TTFT = Histogram("rollout_time_to_first_token_s", "Seconds from request to first token")
POLICY_VERSION = Gauge("rollout_policy_version", "Policy version in force")
UPDATE_SECONDS = Histogram("rollout_weight_update_s", "Seconds to receive and commit a version")
