"""Keys outside the schema: Hydra's `+key=value` and `++key=value` add them to the composed config, where
`OmegaConf.to_object` would silently drop them. A misspelt key must stop the job instead."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from batchgen.config import Config, ConfigError


def _dataclass_fields(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def unknown_keys(values: dict[str, Any], schema: type = Config, prefix: str = "") -> list[tuple[str, list[str]]]:
    """(dotted key, the known keys of its group) for every key of `values` that `schema` lacks, recursing into
    nested dataclasses; free-form dict fields (model.hf_config) hold any key."""
    fields = _dataclass_fields(schema)
    found: list[tuple[str, list[str]]] = []
    for key, value in values.items():
        if key not in fields:
            found.append((f"{prefix}{key}", sorted(fields)))
            continue
        field_type = next((t for t in typing.get_args(fields[key]) if dataclasses.is_dataclass(t)), fields[key])
        if dataclasses.is_dataclass(field_type) and isinstance(value, dict):
            found += unknown_keys(value, field_type, f"{prefix}{key}.")
    return found


def check_known_keys(values: dict[str, Any]) -> None:
    """Raises ConfigError naming every unknown key and the keys its group knows; `hydra` is Hydra's own."""
    unknown = unknown_keys({key: value for key, value in values.items() if key != "hydra"})
    if unknown:
        raise ConfigError("; ".join(
            f"{key} is not a configuration key ({key.rpartition('.')[0] or 'the top level'} has: {', '.join(known)})"
            for key, known in unknown
        ))
