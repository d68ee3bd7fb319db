"""``load(path)``: read a YAML or JSON config file into a validated ``LLMConfig``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from configs.engine import LLMConfig

ModelT = TypeVar("ModelT", bound=BaseModel)


class ConfigError(ValueError):
    """A config that does not validate; the message names each bad field and what it allows."""


def describe_validation_error(exc: ValidationError, source: str) -> str:
    """One line per problem: ``field.path: message (got value)``."""
    lines = [f"{source}: {exc.error_count()} invalid setting(s)"]
    for err in exc.errors():
        where = ".".join(str(part) for part in err["loc"]) or "(config)"
        message = err["msg"].removeprefix("Value error, ")
        got = err.get("input")
        shown = "" if isinstance(got, dict) or err["type"] == "missing" else f" (got {got!r})"
        lines.append(f"  {where}: {message}{shown}")
    return "\n".join(lines)


def validate(model_cls: type[ModelT], data: Any, source: str) -> ModelT:
    """``model_cls.model_validate(data)`` with a ``ConfigError`` naming fields on failure."""
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc, source)) from None


def read_mapping(path: str | Path) -> dict[str, Any]:
    """Parse a ``.yaml``/``.yml``/``.json`` file holding a mapping."""
    path = Path(path)
    if path.suffix not in (".yaml", ".yml", ".json"):
        raise ConfigError(f"{path}: config files must end in .yaml, .yml or .json")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: not valid {path.suffix[1:].upper()}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of settings at the top level, got {type(data).__name__}")
    return data


def load(path: str | Path, model_cls: type[ModelT] = LLMConfig) -> ModelT:  # type: ignore[assignment]
    """Load and validate a config file (``LLMConfig`` unless another model is given)."""
    return validate(model_cls, read_mapping(path), str(path))
