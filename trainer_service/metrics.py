"""Prometheus metrics of the trainer, named ``trainer_<thing>_<unit>`` (deploy/grafana and the alert rules in
deploy/prometheus/alerts.yml read them)."""

from prometheus_client import Counter, Gauge, Histogram, start_http_server

SAMPLES = Counter("trainer_samples_trained", "Samples trained (rate() gives samples/s)")
TOKENS = Counter("trainer_tokens_trained", "Response tokens trained (rate() gives tokens/s)")
STALE_DROPPED = Counter("trainer_stale_dropped", "Samples dropped for exceeding the staleness bound")
DUPLICATES = Counter("trainer_duplicates_skipped", "Groups skipped because the ledger already held them")
STEPS_SKIPPED = Counter("trainer_steps_skipped", "Optimizer steps skipped (non-finite loss or gradient)")
QUEUE_DEPTH = Gauge("trainer_queue_depth", "Trajectory groups waiting on the stream for the trainers")
POLICY_VERSION = Gauge("trainer_policy_version", "Latest policy version of the trainer")
STALENESS_MAX = Gauge("trainer_staleness_max_steps", "Largest staleness in the last step")
MAX_STALENESS = Gauge("trainer_max_staleness_steps", "The staleness bound k in force in the trainer")
STEPS = Counter("trainer_steps", "Training steps taken (skipped ones included)")
LAST_STEP_TIME = Gauge("trainer_last_step_time_s", "Unix time of the last step (of the start, before one)")
STALENESS = Histogram("trainer_staleness_steps", "Staleness of each trained group", buckets=(0, 1, 2, 3, 4, 6, 8, 16))
REWARD = Gauge("trainer_reward_mean", "Mean reward of the last step's batch")
LOSS = Gauge("trainer_loss", "Policy loss of the last step")
GEO_MASKED = Gauge("trainer_geo_mask_masked_ratio", "Sequences rejected by the geometric mask, last step")
ICEPOP_MASKED = Gauge("trainer_icepop_masked_token_ratio", "Tokens zeroed by ICEPOP, last step")
ABS_LOGP_DIFF = Gauge("trainer_mean_abs_logprob_diff", "Mean |logp trainer - logp rollout| of the last step")
# Up to 10 minutes: a large model's publish takes longer than the default buckets' top (10 s).
DURATION_BUCKETS_S = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
PUBLISH_SECONDS = Histogram("trainer_publish_s", "Seconds to publish one weight version", buckets=DURATION_BUCKETS_S)
CHECKPOINT_SECONDS = Histogram("trainer_checkpoint_s", "Seconds to write one checkpoint", buckets=DURATION_BUCKETS_S)


def serve(port: int) -> None:
    """Serve /metrics on ``port``; the start counts as the last progress until the first step (TrainerNotStepping)."""
    LAST_STEP_TIME.set_to_current_time()
    start_http_server(port)


def record_step(values: dict[str, float], new_staleness: list[int], max_staleness: int) -> None:
    """Move the step's figures (Trainer.step output, trainer __main__ additions) into the metrics."""
    STEPS.inc()
    LAST_STEP_TIME.set_to_current_time()
    MAX_STALENESS.set(max_staleness)
    SAMPLES.inc(values.get("samples_step", 0.0))
    TOKENS.inc(values.get("num_tokens", 0.0))
    STALE_DROPPED.inc(values.get("stale_dropped_step", 0.0))
    STEPS_SKIPPED.inc(values.get("skipped", 0.0))
    for lag in new_staleness:
        STALENESS.observe(lag)
    STALENESS_MAX.set(values.get("staleness_max", 0.0))
    REWARD.set(values.get("reward_mean", 0.0))
    LOSS.set(values.get("loss", 0.0))
    GEO_MASKED.set(values.get("geo_mask_masked_ratio", 0.0))
    ICEPOP_MASKED.set(values.get("icepop_masked_token_ratio", 0.0))
    ABS_LOGP_DIFF.set(values.get("mean_abs_logprob_diff", 0.0))
