"""The agreed losses, watched for values that stop being finite: good bytes are not good state.

Every rank feeds it the same mean losses (:mod:`decisions`), so every rank
reaches the same verdicts without another collective. Three facts follow:

- a snapshot is not published when a loss since the last save was non-finite
  (its state came from that step: poison that verifies);
- retention keeps the newest snapshot older than the run's first non-finite
  loss (the last good one before a blow-up);
- a loss that stays non-finite for ``limit`` steps in a row is a blow-up: the
  run rolls back whatever ``--on-anomaly`` says for spikes.

A loss that goes non-finite, or spikes (``--anomaly-sigma``, judged against the
loss window the snapshot carries), within ``limit`` steps after a restore blames
the snapshot restored (:meth:`FiniteWatch.poisoned`). Pure and importable without torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

NONFINITE_STEPS = 3  # non-finite losses in a row that make a blow-up; also the steps after a restore that blame it


def limit_for(anomaly_window: int) -> int:
    """K: ``NONFINITE_STEPS``, bounded by ``--anomaly-window`` (a window of 2 judges within 2 steps)."""
    return max(1, min(NONFINITE_STEPS, anomaly_window))


@dataclass
class FiniteWatch:
    limit: int = NONFINITE_STEPS
    first_nonfinite: int | None = None  # the run's first step with a non-finite loss (this process, or the record)
    streak: int = 0  # non-finite losses in a row, up to the last one seen
    window_nonfinite: int | None = None  # the first non-finite step since the last save began
    last: tuple[int, float] | None = None  # the last agreed (step, loss)
    restored_step: int | None = None  # the step of the snapshot this process restored, until ``limit`` steps pass

    def observe(self, step: int, loss: float) -> bool:
        """One agreed loss; True when it is the run's first non-finite one (worth an event)."""
        self.last = (step, loss)
        if math.isfinite(loss):
            self.streak = 0
            return False
        self.streak += 1
        if self.window_nonfinite is None:
            self.window_nonfinite = step
        first = self.first_nonfinite is None
        if first:
            self.first_nonfinite = step
        return first

    def blown_up(self) -> bool:
        return self.streak >= self.limit

    def poisoned(self, spiked: bool = False) -> bool:
        """The last loss is non-finite, or ``spiked`` (the detector flagged it), within ``limit`` steps of a
        restore: the restored snapshot is to blame."""
        if self.restored_step is None or self.last is None:
            return False
        step, loss = self.last
        if step > self.restored_step + self.limit:
            self.restored_step = None  # past the blame window: later trouble is the training's own
            return False
        return spiked or not math.isfinite(loss)

    def begin_save(self) -> int | None:
        """A save begins: the first non-finite step since the last one (then the snapshot is refused), or None."""
        found, self.window_nonfinite = self.window_nonfinite, None
        return found

    def rolled_back(self) -> None:
        """The state is a snapshot's again: nothing since it counts (``first_nonfinite`` stays: retention keeps it)."""
        self.streak, self.window_nonfinite, self.last = 0, None, None

    def final_nonfinite(self) -> int | None:
        """The step of the last agreed loss when it is non-finite (a run must never end "completed" on it)."""
        if self.last is None or math.isfinite(self.last[1]):
            return None
        return self.last[0]
