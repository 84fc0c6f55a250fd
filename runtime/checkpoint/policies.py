"""Small pure policies over plain data: when to save, which snapshots to keep, when to give up saving.

Each has one decision method and no I/O, so tests drive them with tables.
Importable without torch: ``cli/`` imports :func:`daly` from here, so that the
interval the supervisor advises is the one the runtime uses.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
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


def daly(delta: float, mtbf: float) -> float:
    """Daly's interval √(2δM)·[1 + ⅓√(δ/2M) + (δ/2M)/9] − δ for δ < 2M, else M (its leading term is
    Young's √(2δM)). The one home of the formula: ``ckptrun.cli.recovery_budget.rto_model`` re-exports it."""
    if delta >= 2 * mtbf:
        return mtbf
    ratio = delta / (2 * mtbf)
    return math.sqrt(2 * delta * mtbf) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - delta


@dataclass
class AutoCadence:
    """``--save-every auto``: seconds between saves = Daly(δ, M), at most ``cap``; rank 0 keeps it.

    δ is what a save costs the training loop (the stall of an async save, the
    whole of a sync one), the median of the last ``window`` measured saves: the
    first save also allocates its staging buffers, and one slow save must not
    set the pace. Before the first measurement a save is due at the first step
    boundary (``interval`` 0: a measured δ beats a guess), then none until its
    cost is known (``interval`` None). A change under 1% is not applied, so
    each applied change is one ``cadence`` event.
    """

    mtbf: float
    cap: float | None = None
    window: int = 9
    stalls: list[float] = field(default_factory=list)
    interval: float | None = 0.0

    def started(self) -> None:
        """A save began: until the first cost is known no other is due."""
        if not self.stalls:
            self.interval = None

    def failed(self) -> None:
        """A save failed before any was measured: try again at the next step boundary."""
        if not self.stalls:
            self.interval = 0.0

    def measured(self, stall: float) -> dict[str, Any] | None:
        """Record one save's cost δ; the new cadence (the event's fields) when the interval changes."""
        self.stalls = (self.stalls + [stall])[-self.window:]
        delta = statistics.median(self.stalls)
        best = daly(delta, self.mtbf)
        interval, reason = best, f"Daly(median δ of {len(self.stalls)} save(s), M)"
        if self.cap is not None and best > self.cap:
            interval, reason = self.cap, "capped: the cost per failure stays within --rto-budget"
        if self.interval and abs(interval - self.interval) <= 0.01 * self.interval:
            return None
        self.interval = interval
        return {"interval_s": interval, "stall_s": delta, "mtbf_s": self.mtbf, "daly_s": best, "cap_s": self.cap,
                "reason": reason, "saves_measured": len(self.stalls)}


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
