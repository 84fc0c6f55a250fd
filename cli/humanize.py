"""Byte counts and ages as a person reads them (``1.5 GiB``, ``3m``): one spelling for every command's table.

Shared below the commands and both engines. Importable without torch.
"""

from __future__ import annotations


def human_bytes(count: int) -> str:
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{count} B"


def human_age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for limit, unit, div in ((120, "s", 1), (7200, "m", 60), (172800, "h", 3600)):
        if seconds < limit:
            return f"{seconds / div:.0f}{unit}"
    return f"{seconds / 86400:.0f}d"
