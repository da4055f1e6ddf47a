"""The typed config tree of a run: one schema that every role process reads from a JSON file.

It lives in protos/ because the resolved config is the contract handed from the launcher to each role
process; each role's ``config.py`` re-exports its section. Imports neither torch nor vLLM. One module per
section; ``loading`` turns files and dotted overrides into a ``RunConfig``.
"""

from protos.config.agent import AgentConfig
from protos.config.coordinator import (
    CoordinatorConfig,
    EvalConfig,
    OverlongConfig,
    SamplingConfig,
    TrainingSamplingConfig,
)
from protos.config.launcher import LauncherConfig, RayConfig, RestartPolicy
from protos.config.loading import (
    ENV_ALIASES,
    apply_overrides,
    deep_merge,
    describe_config_error,
    env_overrides,
    field_annotation,
    flag_overrides,
    load_run_config,
    parse_override_value,
    read_config_file,
)
from protos.config.logger import LoggerConfig
from protos.config.rollout import DEMO_MAX_MODEL_LEN, RolloutConfig, RolloutLoraConfig, SyntheticEngineConfig
from protos.config.run import RunConfig
from protos.config.trainer import LoraConfig, MegatronConfig, TrainerConfig
from protos.config.weight_bus import WeightBusConfig

__all__ = [
    "AgentConfig",
    "CoordinatorConfig",
    "DEMO_MAX_MODEL_LEN",
    "ENV_ALIASES",
    "EvalConfig",
    "LauncherConfig",
    "LoggerConfig",
    "LoraConfig",
    "MegatronConfig",
    "OverlongConfig",
    "RayConfig",
    "RestartPolicy",
    "RolloutConfig",
    "RolloutLoraConfig",
    "RunConfig",
    "SamplingConfig",
    "SyntheticEngineConfig",
    "TrainerConfig",
    "TrainingSamplingConfig",
    "WeightBusConfig",
    "apply_overrides",
    "deep_merge",
    "describe_config_error",
    "env_overrides",
    "field_annotation",
    "flag_overrides",
    "load_run_config",
    "parse_override_value",
    "read_config_file",
]
