"""Checks at the entry: each field of the right type, finite, inside what the engine can hold.

`SamplingParams`, `BeamSearchParams` and `EngineConfig` check every field with these, so a bad
value is refused where it enters, with one shape of message that starts with the field's name
(the server reports that name as the request's bad field), says what is allowed, and shows the
value it got:

    temperature must be a finite number >= 0 (0 = greedy), got nan
    top_k must be an integer in [-1, 2147483647] (0 or -1: all tokens), got 9223372036854775808

An int field takes integers only (not bools, floats or strings); a float field takes any real
number but bools, and no NaN or infinity. Each check returns the value as a plain `int` or
`float`. The engine adds the checks that need the model (`engine/processor.py`); lesson 07
(serving) shows a bad field answered as a 400 that names it.
"""
from __future__ import annotations

import math
import numbers
from typing import Optional

INT32_MAX = 2**31 - 1  # top_k's ceiling: a tensor index, clamped to the vocabulary by the sampler
SEED_MIN, SEED_MAX = -2**63, 2**64 - 1  # what torch.Generator.manual_seed takes


def _bounds(lo, hi, lo_open: bool, hi_open: bool) -> str:
    """' in [lo, hi]', ' >= lo', ' < hi', ...; '' without bounds."""
    if lo is not None and hi is not None:
        return f" in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    if lo is not None:
        return f" {'>' if lo_open else '>='} {lo}"
    if hi is not None:
        return f" {'<' if hi_open else '<='} {hi}"
    return ""


def _inside(v, lo, hi, lo_open: bool, hi_open: bool) -> bool:
    return ((lo is None or (v > lo if lo_open else v >= lo))
            and (hi is None or (v < hi if hi_open else v <= hi)))


def _refuse(name: str, what: str, optional: bool, value) -> ValueError:
    return ValueError(f"{name} must be {'None or ' if optional else ''}{what}, got {value!r}")


def check_int(name: str, value, lo: Optional[int] = None, hi: Optional[int] = None, *,
              optional: bool = False, note: str = "") -> Optional[int]:
    """`value` as an int in [lo, hi] (None passes if `optional`); `note` follows the range."""
    if value is None and optional:
        return None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        if _inside(int(value), lo, hi, False, False):
            return int(value)
    raise _refuse(name, f"an integer{_bounds(lo, hi, False, False)}{note}", optional, value)


def check_float(name: str, value, lo: Optional[float] = None, hi: Optional[float] = None, *,
                lo_open: bool = False, hi_open: bool = False, optional: bool = False,
                note: str = "") -> Optional[float]:
    """`value` as a finite float inside the bounds (open where asked); None if `optional`."""
    if value is None and optional:
        return None
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            v = float(value)
        except OverflowError:  # an int too large for a float
            v = math.inf
        if math.isfinite(v) and _inside(v, lo, hi, lo_open, hi_open):
            return v
    raise _refuse(name, f"a finite number{_bounds(lo, hi, lo_open, hi_open)}{note}", optional,
                  value)


def check_bool(name: str, value, *, optional: bool = False) -> Optional[bool]:
    if (value is None and optional) or isinstance(value, bool):
        return value
    raise _refuse(name, "True or False", optional, value)


def check_str(name: str, value, *, optional: bool = False) -> Optional[str]:
    if (value is None and optional) or (isinstance(value, str) and value):
        return value
    raise _refuse(name, "a non-empty string", optional, value)


def check_choice(name: str, value, choices: tuple, *, optional: bool = False, note: str = ""):
    """One of `choices` (compared as strings: `True` is not `1` here)."""
    if (value is None and optional) or (isinstance(value, str) and value in choices):
        return value
    raise _refuse(name, f"one of {choices}{note}", optional, value)


def check_int_list(name: str, value, lo: Optional[int] = None, hi: Optional[int] = None, *,
                   optional: bool = False) -> Optional[list[int]]:
    """A list (or tuple) of ints in [lo, hi], as a new list; None if `optional`."""
    if value is None and optional:
        return None
    if isinstance(value, (list, tuple)):
        try:
            return [check_int(name, v, lo, hi) for v in value]
        except ValueError:
            pass
    raise _refuse(name, f"a list of integers{_bounds(lo, hi, False, False)}", optional, value)
