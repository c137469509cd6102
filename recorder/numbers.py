"""Numbers from outside, made storable: an upstream may report usage as NaN, Infinity or 1e29.

Python's json reads `NaN` and `Infinity` (and any integer, however long), so such a usage
reaches the turn as sent. A token count is kept only when it is one (`count`: a whole
number from 0 to SQLite's 2**63 - 1); anything else is unknown, `None` (NULL), never 0 and
never a float that poisons a sum. The usage object itself is kept as recorded, in strict JSON
(`strict`: a non-finite number is written as the string JSON readers know it by, "NaN",
"Infinity", "-Infinity"), so every reader (exports, the dashboard's API, the analyzer) can
parse what is stored, and what the upstream said is still there to see.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

MAX_COUNT = 2**63 - 1  # SQLite's INTEGER
COUNT_FIELDS = ("prompt_tokens", "completion_tokens", "cached_tokens")
SECONDS_FIELDS = ("ttft_s", "total_s")


def count(value: Any) -> int | None:
    """`value` as a token count, or None when it is not one (NaN, infinite, negative,
    fractional, past 2**63 - 1, not a number)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if 0 <= value <= MAX_COUNT else None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer() and 0 <= value <= MAX_COUNT:
        return int(value)
    return None


def seconds(value: Any) -> float | None:
    """A finite duration, or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value) if not isinstance(value, float) else value
    return value if math.isfinite(value) else None


def _spell(value: float) -> str:
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


def strict(value: Any) -> Any:
    """`value` with every non-finite float replaced by its JSON spelling as a string."""
    if isinstance(value, float):
        return value if math.isfinite(value) else _spell(value)
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """`json.dumps` that always writes strict JSON (see `strict`); the common case costs one pass."""
    try:
        return json.dumps(value, allow_nan=False, **kwargs)
    except ValueError:
        return json.dumps(strict(value), allow_nan=False, **kwargs)


def _refuse(name: str):
    raise ValueError(f"{name} is not JSON")


def loads_strict(text: str) -> Any:
    """`json.loads` that refuses NaN and Infinity (ValueError)."""
    return json.loads(text, parse_constant=_refuse)


def is_strict_json(text: str) -> bool:
    """Whether `text` parses as strict JSON; only texts spelling NaN or Infinity are parsed."""
    if "NaN" not in text and "Infinity" not in text:
        return True
    try:
        loads_strict(text)
    except ValueError:
        return False
    return True


def unusable_counts(turn) -> list[str]:
    """The count fields of `turn` that are set but hold no count (what `usable` clears)."""
    return [name for name in COUNT_FIELDS if getattr(turn, name) is not None and count(getattr(turn, name)) is None]


def usable(turn):
    """`turn` itself when its counts and durations are usable numbers, else a copy with each
    count made an int or None and each non-finite duration None (its usage left as sent)."""
    changes = {}
    for name in COUNT_FIELDS:
        value = getattr(turn, name)
        if value is not None:
            fixed = count(value)
            if fixed is None or type(value) is not int:
                changes[name] = fixed
    for name in SECONDS_FIELDS:
        value = getattr(turn, name)
        if value is not None and seconds(value) is None:
            changes[name] = None
    return dataclasses.replace(turn, **changes) if changes else turn
