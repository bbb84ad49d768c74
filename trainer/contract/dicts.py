"""The JSON round-trip every contract dataclass shares."""

from __future__ import annotations

import dataclasses
from typing import Any


def from_dict(cls: type, data: dict[str, Any]) -> Any:
    """Build a flat dataclass from a dict, naming unknown or missing fields in the error."""
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__}: expected an object, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown field(s) {unknown}; valid fields: {sorted(names)}")
    try:
        return cls(**data)
    except TypeError as e:  # missing required field
        raise ValueError(f"{cls.__name__}: {e}") from None
