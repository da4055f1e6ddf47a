"""The coordinator's section of the run config (schema in ``protos.config``)."""

from protos.config import (
    CoordinatorConfig,
    EvalConfig,
    OverlongConfig,
    RunConfig,
    SamplingConfig,
    TrainingSamplingConfig,
    load_run_config,
)

__all__ = [
    "CoordinatorConfig",
    "EvalConfig",
    "OverlongConfig",
    "RunConfig",
    "SamplingConfig",
    "TrainingSamplingConfig",
    "load_run_config",
]
