"""The coordinator's section of the run config (schema in ``protos.config``)."""

from protos.config import CoordinatorConfig, RunConfig, SamplingConfig, load_run_config

__all__ = ["CoordinatorConfig", "RunConfig", "SamplingConfig", "load_run_config"]
