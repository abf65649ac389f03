"""config.json field checks that several model families share (torch-free).

The families' ``from_config`` collect their problems with these, so that a field of the
wrong type or range is one line naming it, never a traceback from the code that reads it
later (RoPE tables, module shapes).
"""

from __future__ import annotations

import math
from typing import Any

# Above any real size or count and within torch's int64 shape arithmetic: a larger
# integer is a broken file (10**30 would overflow torch's size unpacking).
MAX_INT = 2**31 - 1
# YaRN keys the RoPE tables read: required ones, then optional ones (absent: the default)
YARN_REQUIRED = ("factor", "original_max_position_embeddings")
YARN_OPTIONAL = ("beta_fast", "beta_slow", "attention_factor")
YARN_OPTIONAL_SCALES = ("mscale", "mscale_all_dim")  # 0 means "not set" there


def is_number(value: Any) -> bool:
    """A finite JSON number (not a boolean)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def is_positive(value: Any) -> bool:
    """A finite JSON number above zero."""
    return is_number(value) and value > 0


def int_problem(key: str, value: Any, minimum: int) -> str | None:
    """Why ``value`` is not an integer in ``[minimum, MAX_INT]`` (None when it is)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{key} must be an integer, got {value!r}"
    if value < minimum:
        return f"{key} must be >= {minimum}, got {value}"
    if value > MAX_INT:
        return f"{key} must be at most {MAX_INT}, got {value}"
    return None


def token_id_problem(key: str, value: Any) -> str | None:
    """Why ``value`` is neither null nor a token id (an integer in ``[0, MAX_INT]``; the
    vocabulary bound is the family's cross-key check)."""
    if value is None or int_problem(key, value, 0) is None:
        return None
    return f"{key} must be a token id (an integer >= 0) or null, got {value!r}"


def yarn_problems(scaling: dict[str, Any], required: tuple[str, ...] = YARN_REQUIRED) -> list[str]:
    """Every YaRN key of ``scaling`` (a ``rope_scaling`` object) the RoPE tables would
    fail on: ``required`` and the optional factors must be positive numbers, the mscales
    numbers >= 0, ``truncate`` a boolean."""
    problems = []
    for key in (*required, *YARN_OPTIONAL):
        value = scaling.get(key)
        if (key in required or value is not None) and not is_positive(value):
            problems.append(f"rope_scaling.{key} must be a positive number, got {value!r}")
    for key in YARN_OPTIONAL_SCALES:
        value = scaling.get(key)
        if value is not None and not (is_number(value) and value >= 0):
            problems.append(f"rope_scaling.{key} must be a number >= 0, got {value!r}")
    if not isinstance(scaling.get("truncate", True), bool):
        problems.append(f"rope_scaling.truncate must be true or false, got {scaling['truncate']!r}")
    return problems
