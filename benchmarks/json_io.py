"""The benchmarks' JSON: strict on disk, floats in memory.

JSON has no infinity or NaN (Python's ``Infinity`` / ``NaN`` tokens are refused by strict
parsers), and a failed run's rows are where they appear: they are written as the strings
``"inf"``, ``"-inf"`` and ``"nan"``, and read back as floats. No torch import: the GPU check's
summary reads these files without it.
"""
from __future__ import annotations

import json
import math

_NON_FINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def _strict(value):
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if value != value else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def _floats(value):
    if isinstance(value, str):
        return _NON_FINITE.get(value, value)
    if isinstance(value, dict):
        return {k: _floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_floats(v) for v in value]
    return value


def dump(payload, f, indent: int = 2) -> None:
    """``payload`` as strict JSON into the open file ``f`` (non-finite floats as strings)."""
    json.dump(_strict(payload), f, indent=indent, allow_nan=False)


def load(f):
    """What :func:`dump` wrote to the open file ``f``, its non-finite floats floats again."""
    return _floats(json.load(f))
