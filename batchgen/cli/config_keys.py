"""Keys outside the schema: Hydra's `+key=value` and `++key=value` add them to the composed config, where
`OmegaConf.to_object` would silently drop them, and a plain `key=value` makes Hydra suggest `+key`, which fails as
well. A misspelt key must stop the job, naming the nearest known key."""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any

from batchgen.config import Config, ConfigError

CLOSE_ENOUGH = 0.6  # difflib's own cutoff for a close match


def _dataclass_fields(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _dataclass_of(field_type: Any) -> type | None:
    """The dataclass a field holds (also through Optional), else None."""
    candidates = (field_type, *typing.get_args(field_type))
    return next((t for t in candidates if dataclasses.is_dataclass(t)), None)


def _holds_any_key(field_type: Any) -> bool:
    """A free-form dict field (model.hf_config), whose keys are not the schema's."""
    candidates = (field_type, *typing.get_args(field_type))
    return any(typing.get_origin(t) is dict or t is dict for t in candidates)


def known_keys(schema: type = Config, prefix: str = "") -> list[str]:
    """Every dotted key of the schema: groups (engine.cuda_graph) and values (engine.cuda_graph.capture_sizes)."""
    keys = []
    for name, field_type in _dataclass_fields(schema).items():
        keys.append(f"{prefix}{name}")
        nested = _dataclass_of(field_type)
        if nested is not None:
            keys += known_keys(nested, f"{prefix}{name}.")
    return keys


def is_known_key(key: str, schema: type = Config) -> bool:
    """Whether a dotted key names something in the schema (any key under a free-form dict field does)."""
    name, _, rest = key.partition(".")
    field_type = _dataclass_fields(schema).get(name)
    if field_type is None:
        return False
    if not rest:
        return True
    nested = _dataclass_of(field_type)
    if nested is not None:
        return is_known_key(rest, nested)
    return _holds_any_key(field_type)


def nearest_key(key: str) -> str | None:
    """The known key spelt most like `key`, as a whole or by its last part (a key put in the wrong group), if one
    is close."""
    leaf = key.rpartition(".")[2]

    def likeness(known: str) -> tuple[float, float]:
        whole = difflib.SequenceMatcher(None, key, known).ratio()
        return max(whole, difflib.SequenceMatcher(None, leaf, known.rpartition(".")[2]).ratio()), whole

    candidates = [known for known in known_keys() if not key.startswith(f"{known}.")]  # not its own groups
    best = max(candidates, key=likeness)
    return best if likeness(best)[0] >= CLOSE_ENOUGH else None


def _unknown_key_message(key: str) -> str:
    """Names the nearest known key and the keys of the deepest group of `key` that exists."""
    schema: type = Config
    group: list[str] = []
    for name in key.split(".")[:-1]:
        nested = _dataclass_of(_dataclass_fields(schema).get(name))
        if nested is None:
            break
        schema = nested
        group.append(name)
    nearest = nearest_key(key)
    guess = f": did you mean {nearest}?" if nearest else ""
    return (f"{key} is not a configuration key{guess} ({'.'.join(group) or 'the top level'} has: "
            f"{', '.join(sorted(_dataclass_fields(schema)))})")


def unknown_keys(values: dict[str, Any], schema: type = Config, prefix: str = "") -> list[str]:
    """The dotted key of every key of `values` that `schema` lacks, recursing into nested dataclasses; free-form dict
    fields (model.hf_config) hold any key."""
    fields = _dataclass_fields(schema)
    found: list[str] = []
    for key, value in values.items():
        if key not in fields:
            found.append(f"{prefix}{key}")
            continue
        nested = _dataclass_of(fields[key])
        if nested is not None and isinstance(value, dict):
            found += unknown_keys(value, nested, f"{prefix}{key}.")
    return found


def check_known_keys(values: dict[str, Any]) -> None:
    """Raises ConfigError naming every unknown key, the nearest known key and the keys its group knows; `hydra` is
    Hydra's own."""
    unknown = unknown_keys({key: value for key, value in values.items() if key != "hydra"})
    if unknown:
        raise ConfigError("; ".join(_unknown_key_message(key) for key in unknown))


def check_override_keys(keys: list[str]) -> None:
    """The keys of plain `key=value` overrides (not config groups, not Hydra's own), checked before Hydra composes
    the config: Hydra's own message for an unknown one suggests `+key`, which check_known_keys refuses too."""
    unknown = [key for key in keys if not is_known_key(key)]
    if unknown:
        raise ConfigError("; ".join(_unknown_key_message(key) for key in unknown))
