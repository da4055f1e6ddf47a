"""The trainer's section of the run config (schema in ``protos.config``)."""

from protos.config import RunConfig, TrainerConfig, load_run_config

__all__ = ["RunConfig", "TrainerConfig", "load_run_config"]
