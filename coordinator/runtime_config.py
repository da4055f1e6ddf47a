"""Run-time changes of the run config the coordinator holds (``fleetrl set KEY=VALUE``).

Only the keys in ``SETTABLE`` may change while a run goes on; the others are fixed at start because
something was built from them (the task, the slot arithmetic, the eval schedule, the ports). A key is a
top-level key of the run config (``max_staleness``, ``temperature``) or one of the coordinator section,
``coordinator.`` optional. A change is validated against the whole run config first (the same validators as
at start) and then written into the live config object, which the scheduler, tasks and eval runner all read.
"""

from __future__ import annotations

from typing import Any

import pydantic
import yaml

from protos.config import RunConfig

SETTABLE = (
    "max_staleness",
    "temperature",
    "sampling.top_p",
    "sampling.top_k",
    "sampling.max_tokens",
    "dynamic_sampling",
    "dynamic_sampling_max_tries",
    "overlong.enabled",
    "overlong.buffer_len",
    "overlong.penalty_factor",
    "reward_timeout_s",
    "request_timeout_s",
    "max_attempts",
    "eval.samples_per_problem",
    "eval.timeout_s",
)


class UnknownSetting(KeyError):
    """No such coordinator config key."""


class FixedSetting(Exception):
    """A real key that cannot change while the run goes on."""


def _known_keys(model: type[pydantic.BaseModel], prefix: str = "") -> set[str]:
    keys = set()
    for name, field in model.model_fields.items():
        keys.add(prefix + name)
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
            keys |= _known_keys(annotation, f"{prefix}{name}.")
    return keys


KNOWN = _known_keys(RunConfig)
TOP_LEVEL = {key for key in KNOWN if "." not in key and not any(k.startswith(f"{key}.") for k in KNOWN)}  # not sections


def _get(node: Any, parts: list[str]) -> Any:
    for part in parts:
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    return node


def resolve_key(key: str) -> str:
    """``key`` as written by a user -> its dotted path from the root of the run config."""
    key = key.strip()
    return key if key in TOP_LEVEL else f"coordinator.{key.removeprefix('coordinator.')}"


def apply_setting(run_config: RunConfig, key: str, raw_value: str) -> tuple[str, Any, Any]:
    """Set ``key`` (see ``resolve_key``) to the YAML scalar ``raw_value``; returns (dotted key from the root,
    old value, new value).

    Raises:
        UnknownSetting: ``key`` names no settable config field.
        FixedSetting: the field exists but cannot change at run time.
        ValueError: the value does not validate (the message names the field and the rule).
    """
    key = resolve_key(key)
    if key not in KNOWN:
        name = key.rsplit(".", 1)[-1]
        hint = f" ({name} is a top-level key: write {name}=...)" if name in TOP_LEVEL else ""
        raise UnknownSetting(f"unknown key {key}{hint}; keys settable at run time: {', '.join(SETTABLE)}")
    if key.removeprefix("coordinator.") not in SETTABLE:
        raise FixedSetting(f"{key} is fixed at start and cannot change at run time; settable: {', '.join(SETTABLE)}")
    try:
        value = yaml.safe_load(raw_value)
    except yaml.YAMLError as error:
        raise ValueError(f"{key}: cannot parse {raw_value!r} as a YAML value ({error})") from None
    parts = key.split(".")
    data = run_config.model_dump()
    _get(data, parts[:-1])[parts[-1]] = value
    try:
        checked = RunConfig.model_validate(data)  # the whole tree: cross-field rules apply too
    except pydantic.ValidationError as error:
        details = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        raise ValueError(f"{key}={raw_value!r} is invalid: {details}") from None
    old = _get(run_config, parts)
    new = _get(checked, parts)
    setattr(_get(run_config, parts[:-1]), parts[-1], new)
    return key, old, new
