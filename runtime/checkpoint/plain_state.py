"""Small state without a class: ``run.track(best_val=ckr.Value(float("inf")), counters={"seen": 0})``.

Everything tracked needs ``state_dict``/``load_state_dict``; a best validation loss or a counter should
not need a class written for it. :class:`Value` holds one JSON-able value (``.value``); a plain ``dict``
of JSON-able values is tracked as itself and restored in place (the script's own dict object gets the
snapshot's contents). Both are stored in the snapshot's JSON tree (floats ``inf``/``nan`` included).
Torch-free.
"""

from __future__ import annotations

import json
import math
from typing import Any


class Value:
    """One JSON-able value that survives a restart: read and assign ``.value``."""

    def __init__(self, value: Any = None) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": jsonable(self.value, "Value")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]

    def __repr__(self) -> str:
        return f"Value({self.value!r})"


class PlainDict:
    """A tracked ``dict`` of JSON-able values, saved as a copy and restored into the same dict object."""

    def __init__(self, data: dict[str, Any], name: str) -> None:
        self.data, self.name = data, name

    def state_dict(self) -> dict[str, Any]:
        return {"items": jsonable(self.data, f"track({self.name}=...)")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data.clear()
        self.data.update(state["items"])


def jsonable(value: Any, where: str) -> Any:
    """``value`` once JSON can store it exactly as it is (a copy), else a TypeError that says what to do."""
    try:
        text = json.dumps(value, allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{where}: {exc}; plain values must be JSON-able (numbers, strings, bools, None, "
                        "lists and dicts of them); track an object with state_dict/load_state_dict instead") from None
    copy = json.loads(text)
    if not _same(copy, value):
        raise TypeError(f"{where}: {value!r} does not survive JSON unchanged (tuples become lists, keys strings); "
                        "store lists and string keys")
    return copy


def _same(copy: Any, value: Any) -> bool:
    """Whether ``value`` reads back from JSON as ``copy`` unchanged: the same containers (a tuple is not a
    list), the same keys (``1`` is not ``"1"``), equal scalars, NaN where NaN was."""
    if isinstance(copy, dict):
        return isinstance(value, dict) and list(copy) == list(value) and all(_same(copy[k], value[k]) for k in copy)
    if isinstance(copy, list):
        return isinstance(value, list) and len(copy) == len(value) and all(map(_same, copy, value))
    if isinstance(copy, float) and math.isnan(copy):
        return isinstance(value, float) and math.isnan(value)
    return bool(copy == value)


def hint(obj: Any) -> str:
    """The fix for a plain value given to ``track`` as it is (it could never be restored in place)."""
    return f" (wrap a plain value: ckr.Value({obj!r}))" if isinstance(obj, (int, float, str, bool, list, tuple)) else ""


def trackable(name: str, obj: Any) -> Any:
    """What ``run.track(name=obj)`` keeps: a plain dict wrapped; anything else as given."""
    return PlainDict(obj, name) if type(obj) is dict else obj
