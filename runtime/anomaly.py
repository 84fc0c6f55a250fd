"""Loss anomaly detection: a non-finite loss, or a spike of more than k standard deviations.

Every rank feeds it the same all-reduced loss, so every rank reaches the same
verdict without another collective. Pure and importable without torch.
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
    history: deque = field(default_factory=deque)

    def check(self, loss: float) -> str | None:
        """A reason when ``loss`` is anomalous, else None (and the loss joins the window)."""
        if not math.isfinite(loss):
            return f"non-finite loss {loss}"
        if len(self.history) >= self.min_history:
            mean = sum(self.history) / len(self.history)
            std = math.sqrt(sum((x - mean) ** 2 for x in self.history) / len(self.history))
            if std > 0 and loss > mean + self.sigma * std:
                return f"loss {loss:.6g} is {(loss - mean) / std:.1f} std above the mean {mean:.6g} of the last {len(self.history)} steps"
        self.history.append(loss)
        while len(self.history) > self.window:
            self.history.popleft()
        return None
