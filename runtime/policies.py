"""Small pure policies over plain data: when to save, which snapshots to keep, when to give up saving.

Each has one decision method and no I/O, so tests drive them with tables.
Importable without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(frozen=True)
class SaveCadence:
    """Save every N optimizer steps and/or when T seconds passed since the last save."""

    every_steps: int | None = None
    every_seconds: float | None = None

    def step_due(self, step: int) -> bool:
        """The deterministic part: every rank computes the same answer."""
        return self.every_steps is not None and step > 0 and step % self.every_steps == 0

    def time_due(self, now: float, last_save: float) -> bool:
        """The clock part: decided on rank 0 only and shared (clocks of ranks differ)."""
        return self.every_seconds is not None and now - last_save >= self.every_seconds


@dataclass(frozen=True)
class Retention:
    """Keep the newest ``keep_last`` verified snapshots of the lineage plus milestones.

    Deletion happens only after a newer snapshot is published and verified, and
    never touches the newest verified one.
    """

    keep_last: int = 3
    keep_every: int | None = None

    def is_milestone(self, step: int) -> bool:
        return self.keep_every is not None and step > 0 and step % self.keep_every == 0

    def to_delete(self, verified_steps: list[int]) -> list[int]:
        """Steps (of the current lineage, all verified) that may be deleted now."""
        ordered = sorted(set(verified_steps), reverse=True)
        keep = set(ordered[: max(1, self.keep_last)])
        return sorted(step for step in ordered if step not in keep and not self.is_milestone(step))


@dataclass
class FailedSaves:
    """N consecutive failed saves stop the run rather than train for hours without a snapshot."""

    limit: int = 3
    consecutive: int = 0

    def record(self, ok: bool) -> bool:
        """Record a save's outcome; True when the run must stop."""
        self.consecutive = 0 if ok else self.consecutive + 1
        return self.consecutive >= self.limit


# Config keys that may change on resume without being listed: run length, cadence, logging, paths.
ALWAYS_ALLOWED = ("steps", "max_steps", "total_steps", "epochs", "max_epochs")
ALLOWED_PREFIXES = ("save_", "log", "eval_", "keep_", "ckpt", "checkpoint", "out")
ALLOWED_SUFFIXES = ("_dir", "dir", "_path", "path", "_file")


def refused_changes(saved: dict[str, Any], current: dict[str, Any], allowed: Sequence[str]) -> list[str]:
    """Config keys whose value changed since the snapshot and that may not change (hyperparameters)."""
    def may_change(key: str) -> bool:
        return (key in allowed or key in ALWAYS_ALLOWED or key.startswith(ALLOWED_PREFIXES)
                or key.endswith(ALLOWED_SUFFIXES))

    return sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k) and not may_change(k))
