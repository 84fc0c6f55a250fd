"""Loss anomaly detection: a non-finite loss, or a spike of more than k standard deviations.

Every rank feeds it the same all-reduced loss, so every rank reaches the same
verdict without another collective. The window's mean and spread are kept as
running sums (O(1) per step: this runs every step), shifted by a reference
value near the mean so that a flat loss keeps its small spread exact, and
summed afresh once per window so rounding never accumulates. Pure and
importable without torch.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

POLICIES = ("warn", "stop", "rollback")


@dataclass
class AnomalyDetector:
    """Flags a loss that is non-finite or above mean + sigma·std of the last ``window`` normal losses."""

    window: int = 50
    sigma: float = 6.0
    min_history: int = 10
    history: deque = field(default_factory=deque)  # may be cleared from outside (a rollback): the sums follow
    _shift: float = field(default=0.0, repr=False)
    _sum: float = field(default=0.0, repr=False)  # of (x - shift) over history
    _squares: float = field(default=0.0, repr=False)  # of (x - shift)² over history
    _summed: int = field(default=0, repr=False)  # len(history) the sums describe
    _until_resum: int = field(default=0, repr=False)

    def check(self, loss: float) -> str | None:
        """A reason when ``loss`` is anomalous, else None (and the loss joins the window)."""
        if not math.isfinite(loss):
            return f"non-finite loss {loss}"
        if self._summed != len(self.history) or self._until_resum <= 0:
            self._resum()
        count = len(self.history)
        if count >= self.min_history:
            offset = self._sum / count
            mean = self._shift + offset
            std = math.sqrt(max(0.0, self._squares / count - offset * offset))
            if std > 0 and loss > mean + self.sigma * std:
                return f"loss {loss:.6g} is {(loss - mean) / std:.1f} std above the mean {mean:.6g} of the last {count} steps"
        self._add(loss)
        return None

    def _add(self, loss: float) -> None:
        if not self.history:  # the first loss of a window is as good a reference as its mean
            self._shift, self._sum, self._squares = loss, 0.0, 0.0
        self.history.append(loss)
        delta = loss - self._shift
        self._sum += delta
        self._squares += delta * delta
        while len(self.history) > self.window:
            old = self.history.popleft() - self._shift
            self._sum -= old
            self._squares -= old * old
        self._summed = len(self.history)
        self._until_resum -= 1

    def _resum(self) -> None:
        """The sums from the window itself, shifted by its mean (once per window, and after a change from outside)."""
        count = len(self.history)
        self._shift = sum(self.history) / count if count else 0.0
        deltas = [x - self._shift for x in self.history]
        self._sum, self._squares = sum(deltas), sum(d * d for d in deltas)
        self._summed, self._until_resum = count, self.window
