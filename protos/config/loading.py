"""Config files and dotted overrides -> a validated RunConfig; user errors as one line."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel

from protos.config.run import RunConfig

logger = logging.getLogger(__name__)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides to a nested dict, each value parsed by the type of the field it sets.

    Text fields (``str``, and ``Literal`` choices of text such as ``rollout.return_routed_experts=on``) take the
    text as written: YAML would read ``on`` as ``True`` and ``42`` as a number, which the field then refuses.
    Every other field takes the value as a YAML scalar or list (``trainer.icepop=[0.5, 2.0]``, ``x=null``).
    """
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} is not KEY=VALUE (e.g. trainer.lr=1e-6)")
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r}: {part!r} is not a section")
        try:
            node[parts[-1]] = parse_override_value(field_annotation(parts), raw)
        except yaml.YAMLError:
            raise ValueError(f"override {item!r}: {raw!r} is not a valid value (YAML)") from None
    return data


def field_annotation(parts: list[str]) -> Any:
    """The annotation of the RunConfig field ``a.b.c`` names, or None for an unknown key (validation names it)."""
    model: type[BaseModel] = RunConfig
    for index, part in enumerate(parts):
        field = model.model_fields.get(part)
        if field is None:
            return None
        annotation = field.annotation
        if index == len(parts) - 1:
            return annotation
        section = _section_model(annotation)
        if section is None:
            return None
        model = section
    return None


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The config section a field holds (``X`` or ``X | None``), or None for a plain value."""
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _text_choices(annotation: Any) -> bool:
    """True for ``str``, ``Literal`` of strings only, and either of them ``| None``."""
    if annotation is str:
        return True
    if get_origin(annotation) is Literal:
        return all(isinstance(choice, str) for choice in get_args(annotation))
    args = get_args(annotation)
    if type(None) in args:
        rest = [arg for arg in args if arg is not type(None)]
        return len(rest) == 1 and _text_choices(rest[0])
    return False


def parse_override_value(annotation: Any, raw: str) -> Any:
    """``raw`` as the value a field of type ``annotation`` takes (see ``apply_overrides``)."""
    if annotation is not None and _text_choices(annotation):
        optional = type(None) in get_args(annotation)
        if optional and raw.strip() in ("null", "~", "None"):
            return None
        value = yaml.safe_load(raw) if raw[:1] in ("'", '"') else raw  # quoted values ('{problem}?') still unquote
        return value if isinstance(value, str) else raw
    return yaml.safe_load(raw)


def flag_overrides(flags: dict[str, object | None]) -> list[str]:
    """Command-line flags that alias config keys (``--model`` = ``model_path``), as dotted overrides to put before
    the user's own; a flag not given (None) sets nothing. The config stays the one source of every setting."""
    return [f"{key}={value}" for key, value in flags.items() if value is not None]


# The launch guide's run variables (shared/seeds: SkyRL's Beam scripts) and the config keys they set.
ENV_ALIASES = {
    "MAX_TRAINING_STEPS": "num_steps",
    "REASONING_EFFORT": "coordinator.reasoning_effort",
    "LOGGER": "logger.backend",
    "RUN_NAME": "run_id",
    "PROJECT_NAME": "logger.project_name",
    "LOG_PATH": "logger.log_path",
    "CKPT_PATH": "trainer.ckpt_dir",
    "EXPORT_PATH": "export_dir",
    "CKPT_INTERVAL": "trainer.ckpt_interval",
    "RESUME_MODE": "trainer.resume",
    "MODEL_PATH": "model_path",
    "DATA_DIR": "data_dir",
    "OPTIMIZER_STATE_DISK_DIR": "trainer.megatron.optimizer_state_disk_dir",
    "KV_CACHE_DTYPE": "rollout.kv_cache_dtype",
}
# Set but empty means "unset", except where the guide gives the empty value a meaning (host memory, not disk).
_EMPTY_IS_A_VALUE = {"OPTIMIZER_STATE_DISK_DIR"}


def env_overrides(environ: Mapping[str, str]) -> list[str]:
    """The ``ENV_ALIASES`` variables set in ``environ``, as dotted overrides (to go before the command line's)."""
    return [
        f"{key}={environ[name]}"
        for name, key in ENV_ALIASES.items()
        if name in environ and (environ[name] or name in _EMPTY_IS_A_VALUE)
    ]


BASE_KEY = "base"  # a config file's base: another file (relative to it) whose values this one overrides


def load_run_config(
    path: str | Path | list[str | Path] | tuple[str | Path, ...] | None = None,
    overrides: list[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> RunConfig:
    """Load YAML/JSON config files (or defaults), deep-merged in order, and apply dotted overrides.

    A file may name a ``base:`` file (relative to itself), loaded first and overridden by the file's own keys:
    recipes are a base plus a small delta. ``environ`` (the commands that start a run from a recipe pass
    ``os.environ``) adds the ``ENV_ALIASES`` set there: an environment variable overrides the files, a dotted
    override overrides both. Raises ValueError naming the file or the field on any user error
    (``describe_config_error`` makes it one line).
    """
    paths = [] if path is None else [path] if isinstance(path, str | Path) else list(path)
    data: dict[str, Any] = {}
    for each in paths:
        data = deep_merge(data, read_config_file(Path(each)))
    from_env = env_overrides(environ) if environ is not None else []
    if from_env:
        logger.info("config from the environment: %s", " ".join(from_env))
    return RunConfig.model_validate(apply_overrides(data, [*from_env, *(overrides or [])]))


def read_config_file(path: Path, _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """One config file as a dict, its ``base`` chain merged under it."""
    resolved = path.resolve()
    if resolved in _chain:
        raise ValueError(f"config file {path}: its base chain loops back to itself")
    try:
        loaded = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"config file {path} does not exist") from None
    except yaml.YAMLError as error:
        raise ValueError(f"config file {path} is not valid YAML: {str(error).splitlines()[0]}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"config file {path} must hold a mapping at the top level")
    base = loaded.pop(BASE_KEY, None)
    if base is None:
        return loaded
    if not isinstance(base, str):
        raise ValueError(f"config file {path}: '{BASE_KEY}' must be a file path, got {base!r}")
    return deep_merge(read_config_file(path.parent / base, (*_chain, resolved)), loaded)


def deep_merge(base: dict[str, Any], delta: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``delta`` on top: sections merge key by key, any other value replaces."""
    merged = dict(base)
    for key, value in delta.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def describe_config_error(error: ValueError) -> str:
    """One line for a user: each failing field with its message (pydantic's report is one line per detail)."""
    from pydantic import ValidationError

    if isinstance(error, ValidationError):
        return "; ".join(
            f"{'.'.join(str(part) for part in detail['loc']) or 'config'}: {detail['msg']}{_top_level_hint(detail)}"
            for detail in error.errors()
        )
    return str(error).replace("\n", " ")


def _top_level_hint(detail: Any) -> str:
    """For an unknown key inside a section whose name is a top-level key (``trainer.max_staleness``): where it is."""
    loc = detail["loc"]  # () for a rule across sections (a RunConfig validator)
    if detail["type"] == "extra_forbidden" and len(loc) > 1 and loc[-1] in RunConfig.model_fields:
        name = loc[-1]
        return f" ({name} is a top-level key: write {name}=...)"
    return ""
