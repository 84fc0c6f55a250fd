"""Durations a person types (``90s``, ``5m``, ``3h``, ``1ms``, ``1h30m``, bare seconds) and how we print them.

One parser for every duration flag, so ``--mtbf 3h`` and ``--budget 90s`` read
the same way everywhere. A bad value becomes one line that names it and the
accepted forms. Importable without torch.
"""

from __future__ import annotations

import math
import re

UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)"
BARE_RE = re.compile(rf"^{NUMBER}$")
PART_RE = re.compile(rf"({NUMBER})(ms|s|m|h|d)")
COMPOUND_RE = re.compile(rf"^(?:{NUMBER}(?:ms|s|m|h|d))+$")
FORMS = "seconds (90, 0.5) or a number with a unit: 1ms, 90s, 5m, 3h, 2d, or a sum such as 1h30m"


class DurationError(ValueError):
    """The text is not a duration; the message names it and the accepted forms."""


def parse_duration(text: str) -> float:
    """Seconds in ``text``: a bare number of seconds, or number+unit parts added up (``1h30m`` = 5400)."""
    value = text.strip().lower()
    if BARE_RE.match(value):
        return float(value)
    if not COMPOUND_RE.match(value):
        raise DurationError(f"{text!r} is not a duration; use {FORMS}")
    units = [unit for _, unit in PART_RE.findall(value)]
    if len(set(units)) != len(units):
        raise DurationError(f"{text!r} repeats a unit; use {FORMS}")
    return sum(float(number) * UNITS[unit] for number, unit in PART_RE.findall(value))


def format_duration(seconds: float | None) -> str:
    """Short human form: ``250 ms``, ``5.4 s``, ``12.5 min``, ``3.1 h``, ``2.0 d``; ``-`` when unknown."""
    if seconds is None or math.isnan(seconds):
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms" if seconds >= 0.001 or seconds == 0 else f"{seconds * 1000:.3f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"
