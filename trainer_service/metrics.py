"""Prometheus metrics of the trainer, named ``trainer_<thing>_<unit>`` (deploy/grafana reads them)."""

from prometheus_client import Counter, Gauge, Histogram

SAMPLES = Counter("trainer_samples_trained", "Samples trained (rate() gives samples/s)")
TOKENS = Counter("trainer_tokens_trained", "Response tokens trained (rate() gives tokens/s)")
STALE_DROPPED = Counter("trainer_stale_dropped", "Samples dropped for exceeding the staleness bound")
DUPLICATES = Counter("trainer_duplicates_skipped", "Groups skipped because the ledger already held them")
STEPS_SKIPPED = Counter("trainer_steps_skipped", "Optimizer steps skipped (non-finite loss or gradient)")
QUEUE_DEPTH = Gauge("trainer_queue_depth", "Trajectory groups waiting on the stream for the trainers")
POLICY_VERSION = Gauge("trainer_policy_version", "Latest policy version of the trainer")
STALENESS_MAX = Gauge("trainer_staleness_max_steps", "Largest staleness in the last step")
STALENESS = Histogram("trainer_staleness_steps", "Staleness of each trained group", buckets=(0, 1, 2, 3, 4, 6, 8, 16))
REWARD = Gauge("trainer_reward_mean", "Mean reward of the last step's batch")
LOSS = Gauge("trainer_loss", "Policy loss of the last step")
GEO_MASKED = Gauge("trainer_geo_mask_masked_ratio", "Sequences rejected by the geometric mask, last step")
ICEPOP_MASKED = Gauge("trainer_icepop_masked_token_ratio", "Tokens zeroed by ICEPOP, last step")
ABS_LOGP_DIFF = Gauge("trainer_mean_abs_logprob_diff", "Mean |logp trainer - logp rollout| of the last step")
PUBLISH_SECONDS = Histogram("trainer_publish_s", "Seconds to publish one weight version")
CHECKPOINT_SECONDS = Histogram("trainer_checkpoint_s", "Seconds to write one checkpoint")


def record_step(values: dict[str, float], new_staleness: list[int]) -> None:
    """Move the step's figures (Trainer.step output, trainer __main__ additions) into the metrics."""
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
