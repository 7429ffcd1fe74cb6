"""The checks of single config values (an integer, a positive number, a choice, a mapping of
known keys), each appending a Problem with its key path instead of raising, so one pass over the
file finds every problem. Numbers must be finite: `.nan` and `.inf` are YAML floats, never a
sensible setting.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from nanaudit.errors import Problem

Problems = list[Problem]


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """"; did you mean `x`?" for the closest candidate, or "" when none is close."""
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean `{close[0]}`?" if close else ""


def check_unknown(mapping: Mapping, known: Sequence[str], prefix: str,
                  problems: Problems) -> None:
    """A problem for every key of `mapping` that is not `known`, suggesting the closest."""
    for key in mapping:
        if key in known:
            continue
        hint = did_you_mean(str(key), known) or f"; known keys: {', '.join(known)}"
        problems.append(Problem(f"{prefix}{key}", f"unknown key{hint}"))


def is_number(value: Any) -> bool:
    """A finite int or float (YAML's `.nan` and `.inf` are floats, but never a setting)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def finite_word(value: Any) -> str:
    """'finite ' when the value is a number that is NaN or infinite, for the message."""
    return "finite " if isinstance(value, float) and not math.isfinite(value) else ""


def has_nonfinite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return any(has_nonfinite(v) for v in value)
    if isinstance(value, dict):
        return any(has_nonfinite(v) for v in value.values())
    return False


def integer(value: Any, key: str, problems: Problems,
            limit: int | None = 2**63 - 1) -> int | None:
    """An integer; within +-limit, the largest count or interval torch and Python's
    containers take (a larger one fails deep inside them, not here)."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        problems.append(Problem(key, f"expected an integer, got {value!r}"))
        return None
    if limit is not None and abs(value) > limit:
        problems.append(Problem(key, f"expected an integer below 2**63, got {value}"))
        return None
    return value


def positive_int(value: Any, key: str, problems: Problems) -> int | None:
    number = integer(value, key, problems)
    if number is not None and number < 1:
        problems.append(Problem(key, f"expected a positive integer, got {number}"))
        return None
    return number


def positive_float(value: Any, key: str, problems: Problems) -> float | None:
    if value is None:
        return None
    if not is_number(value) or value <= 0:
        problems.append(Problem(key, f"expected a positive {finite_word(value)}number, "
                                f"got {value!r}"))
        return None
    return float(value)


def boolean(value: Any, key: str, problems: Problems) -> bool | None:
    if value is not None and not isinstance(value, bool):
        problems.append(Problem(key, f"expected true or false, got {value!r}"))
        return None
    return value


def choice(value: Any, key: str, choices: Sequence[str], problems: Problems) -> str:
    """One of `choices` (the first, the default, when it is not)."""
    if value not in choices:
        problems.append(Problem(key, f"expected one of {', '.join(choices)}, got {value!r}"))
        return choices[0]
    return value


def mapping(value: Any, key: str, known: Sequence[str], problems: Problems) -> dict:
    """A section's mapping, its unknown keys reported and left out."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        problems.append(Problem(key, f"expected a mapping, got {value!r}"))
        return {}
    check_unknown(value, known, f"{key}.", problems)
    return {k: v for k, v in value.items() if k in known}


def positive_field(raw: Mapping, section: str, name: str, defaults: Any, problems: Problems,
                   integral: bool = False) -> Any:
    """raw[name] as a positive number (the section's default when absent or wrong)."""
    default = getattr(defaults, name)
    parse = positive_int if integral else positive_float
    value = parse(raw.get(name, default), f"{section}.{name}", problems)
    return default if value is None else value


def threshold(value: Any, key: str, problems: Problems, default: Any) -> Any:
    """A positive number, or false to turn the detector off."""
    if value is False:
        return False
    if value is True:
        return default
    return positive_float(value, key, problems) or default


def every(value: Any, key: str, problems: Problems, default: int) -> int:
    """Every N steps: an integer >= 0 (0 or false: off; true: every step)."""
    if value is False:
        return 0
    if value is True:
        return 1
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63:
        problems.append(Problem(key, f"expected a step interval (0 for off), got {value!r}"))
        return default
    return value
