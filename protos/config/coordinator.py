"""The coordinator's section: prompts, grouping, sampling, admission, eval, the admin API."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from protos.config.base import Strict


class TrainingSamplingConfig(Strict):
    """Sampling of training rollouts; their temperature is the run's top-level ``temperature`` (the trainer reads it
    too), so ``RunConfig.training_sampling()`` is what a request gets."""

    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(-1, description="Top-k; -1 disables.")
    max_tokens: int = Field(8, gt=0, description="Maximum response tokens per sample.")


class SamplingConfig(TrainingSamplingConfig):
    """The sampling of one request: an eval section's own (``coordinator.eval.sampling``), or the training sampling
    at the run's temperature."""

    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature; 1.0 keeps logprobs exact.")


class OverlongConfig(Strict):
    """DAPO soft overlong punishment, added to the reward of long responses."""

    enabled: bool = Field(False, description="Apply the penalty to training rewards (never to eval).")
    buffer_len: int = Field(
        0, ge=0, description="Ramp length in tokens: the penalty grows from 0 at max_tokens - buffer_len to -factor."
    )
    penalty_factor: float = Field(1.0, ge=0, description="Penalty at and beyond sampling.max_tokens.")


class EvalConfig(Strict):
    """Evaluation rounds, each pinned to one policy version (every sample comes from exactly that version)."""

    datasets: list[str] = Field(
        default_factory=list, description="Eval files (.jsonl/.parquet); metrics are keyed by file stem."
    )
    interval_steps: int = Field(0, ge=0, description="Evaluate every this many trainer steps; 0 = never.")
    at_start: bool = Field(False, description="Also evaluate the initial policy before training starts.")
    samples_per_problem: int = Field(4, gt=0, description="k samples per problem; reports mean accuracy and pass@k.")
    limit: int | None = Field(None, gt=0, description="Use only the first N problems of each file; None = all.")
    sampling: SamplingConfig | None = Field(
        None, description="Eval sampling; None = the training sampling at the run's temperature."
    )
    reward_fn: str = Field("math", description="Reward of eval samples; a sample is correct when reward >= 1.")
    timeout_s: float = Field(600.0, gt=0, description="Longest wait for one eval round (version, servers, samples).")
    labels: dict[str, str] = Field(
        default_factory=dict,
        description="Metric label per eval file (the path as written in datasets): metrics are "
        "eval/<label>/*. A file not listed takes its rows' data_source, or its file stem when they carry none.",
    )

    @model_validator(mode="after")
    def _labels_name_datasets(self) -> EvalConfig:
        unknown = sorted(set(self.labels) - set(self.datasets))
        if unknown:
            raise ValueError(f"coordinator.eval.labels: {unknown} not in coordinator.eval.datasets {self.datasets}")
        bad = [label for label in self.labels.values() if not label or "/" in label]
        if bad:
            raise ValueError(f"coordinator.eval.labels: {bad} must be non-empty without '/' (part of metric names)")
        return self


BUILT_IN_TASKS = ("echo", "tail")  # coordinator.task values that name no file


class CoordinatorConfig(Strict):
    """Prompts, grouping, admission and the push onto the trajectory queue."""

    task: str = Field(
        "echo",
        description="Built-in task ('echo'; 'tail': long-tailed response lengths) or a dataset path (.jsonl/.parquet).",
    )
    tail_min_tokens: int = Field(
        1, ge=1, description="The tail task's shortest response; lengths are log-uniform up to sampling.max_tokens."
    )
    reward_fn: str = Field(
        "math", description="Dataset tasks: built-in reward ('math') or 'module.path:function' (sync or async)."
    )
    prompt_template: str = Field(
        "", description="Template with '{problem}' for plain {problem, answer} rows; '' = the loader's default."
    )
    template_chat_prompts: bool = Field(False, description="Also apply prompt_template to verl/DAPO chat rows.")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra variables for the tokenizer's chat template, e.g. reasoning_effort."
    )
    dataset_limit: int | None = Field(None, gt=0, description="Use only the first N rows of the dataset; None = all.")
    group_size: int = Field(8, gt=0, description="Samples per prompt (GRPO group size n).")
    sampling: TrainingSamplingConfig = Field(default_factory=TrainingSamplingConfig)
    overlong: OverlongConfig = Field(default_factory=OverlongConfig)
    dynamic_sampling: bool = Field(
        False, description="Skip groups whose rewards are all equal and admit a new prompt in their place."
    )
    dynamic_sampling_max_tries: int = Field(
        8, gt=0, description="Prompts tried per group slot before a uniform group is pushed anyway (counted)."
    )
    reward_timeout_s: float = Field(30.0, gt=0, description="Limit of one reward call; a timeout scores 0.")
    reward_threads: int = Field(2, gt=0, description="Threads that run sync reward functions off the event loop.")
    eval: EvalConfig = Field(default_factory=EvalConfig)
    request_timeout_s: float = Field(120.0, gt=0, description="Deadline of one Generate call.")
    max_attempts: int = Field(3, gt=0, description="Dispatch attempts of one group before the run fails.")
    admin_host: str = Field("127.0.0.1", description="Interface the admin gRPC API and /metrics bind.")
    admin_port: int = Field(50050, ge=0, description="Admin gRPC API port (fleetrl status, ...); 0 picks a free one.")
    metrics_port: int = Field(0, ge=0, description="Prometheus /metrics port; 0 = off.")
    seed: int = Field(0, description="Seed of the prompt order.")
    dashboard: bool = Field(True, description="Serve the live web dashboard from the coordinator.")
    dashboard_host: str = Field("127.0.0.1", description="Interface the dashboard binds.")
    dashboard_port: int = Field(0, ge=0, description="Dashboard port; 0 picks a free one (logged).")
    reasoning_effort: Literal["minimal", "low", "medium", "high", "xhigh", "max"] | None = Field(
        None,
        description="Passed to the chat template as reasoning_effort (Beam's template reads it; training and eval "
        "prompts alike); None = the template's default. Env alias REASONING_EFFORT.",
    )

    discovery: bool = Field(
        True,
        description="Route to the rollout servers that register in the run's fleet hash (besides --servers and "
        "`fleetrl servers add`), and stop routing to those whose registration is older than server_timeout_s.",
    )
    server_timeout_s: float = Field(
        10.0, gt=0, description="Discovery: a server whose last registration is older than this is dropped."
    )

    @model_validator(mode="after")
    def _overlong_fits(self) -> CoordinatorConfig:
        if self.overlong.enabled and self.overlong.buffer_len > self.sampling.max_tokens:
            raise ValueError(
                f"coordinator.overlong.buffer_len ({self.overlong.buffer_len}) must not exceed "
                f"coordinator.sampling.max_tokens ({self.sampling.max_tokens}); lower the buffer"
            )
        if self.reasoning_effort is not None and "reasoning_effort" in self.chat_template_kwargs:
            raise ValueError(
                "coordinator.reasoning_effort and coordinator.chat_template_kwargs.reasoning_effort are both set; "
                "keep coordinator.reasoning_effort only"
            )
        if self.dynamic_sampling and self.group_size < 2:
            raise ValueError(
                "coordinator.dynamic_sampling needs coordinator.group_size >= 2 (a group of one "
                "always has equal rewards)"
            )
        return self

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's variables: ``chat_template_kwargs`` plus ``reasoning_effort`` when set."""
        if self.reasoning_effort is None:
            return dict(self.chat_template_kwargs)
        return {**self.chat_template_kwargs, "reasoning_effort": self.reasoning_effort}
