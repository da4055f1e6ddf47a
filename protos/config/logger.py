"""The run logger's section: where a run's step and eval figures go besides the role logs."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from protos.config.base import Strict


class LoggerConfig(Strict):
    """The run logger (``launcher/run_logger.py``): it tails the trainer's and the coordinator's metrics reports
    and writes each step's figures to the console or to a Weights & Biases run."""

    backend: Literal["console", "wandb"] = Field(
        "console",
        description="'console': one line per step on the launcher's output (and its log). 'wandb': also a Weights & "
        "Biases run (project_name, named run_id); WANDB_MODE=offline writes it under log_path without a network.",
    )
    project_name: str = Field("fleetrl", min_length=1, description="The Weights & Biases project of the run.")
    log_path: str = Field(
        "",
        description="Directory of the role processes' logs and the Weights & Biases run files; '~' and '{run_id}' "
        "expand; '' = <out_dir>/logs.",
    )
