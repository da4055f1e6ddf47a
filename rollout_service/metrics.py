"""Prometheus metrics of a rollout server, named ``rollout_<thing>_<unit>`` (``rollout/`` in docs)."""

from prometheus_client import Counter, Gauge, Histogram

TOKENS = Counter("rollout_generated_tokens", "Tokens generated (rate() gives tokens/s)")
RUNNING = Gauge("rollout_requests_running", "Generate calls in flight")
WAITING = Gauge("rollout_requests_waiting", "Requests queued in the engine scheduler (last engine step)")
KV_CACHE_USAGE = Gauge("rollout_kv_cache_usage_ratio", "Fraction of the KV cache in use (last engine step)")
REJECTED = Counter("rollout_requests_rejected", "Generate calls rejected", ["reason"])  # invalid | busy | draining
TTFT = Histogram("rollout_time_to_first_token_s", "Seconds from request to first token")
POLICY_VERSION = Gauge("rollout_policy_version", "Policy version in force")
UPDATE_SECONDS = Histogram("rollout_weight_update_s", "Seconds to receive and commit a version")
UPDATE_PAUSE_SECONDS = Histogram("rollout_weight_update_pause_s", "Seconds generation was paused for a commit")


def track_engine(engine) -> None:
    """Read the engine's scheduler figures and version at scrape time instead of pushing them."""
    WAITING.set_function(lambda: engine.load()[1])
    KV_CACHE_USAGE.set_function(lambda: engine.load()[2])
    POLICY_VERSION.set_function(lambda: engine.policy_version)
