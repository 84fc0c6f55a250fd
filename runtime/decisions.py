"""The per-step facts all ranks must share, agreed one step late so that no step waits for them.

At the end of step k every rank puts its facts — its loss, whether it wants to
stop (a stop file), whether a save is due by its clock (only rank 0's counts),
whether its save budget is spent — into one small all-reduce that it *starts*
there (``async_op``) and *reads* at the end of step k+1, when the sum has long
arrived behind step k+1's compute. Ranks read step k's sums at the same point
of the program: the end of step k+1, or earlier at a boundary that every rank
reaches at the same step (a save, a stop, the end of the loop, ``finish``).
So every rank acts on the same decision at the same step: a stop asked during
step k saves at step k+1's boundary, and no rank ever waits on a collective
the others skip. Step k's metrics line waits for its mean loss and is written
when the sum is read — before any snapshot of step k or later, so a resume
never lacks a line it replays from. A world of one sums nothing but keeps the
same timing, so a single-process run takes the decisions a multi-rank run
would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckptrun.runtime.collectives import PendingSum, start_sum


@dataclass
class Agreed:
    """One step's facts as every rank sees them once summed."""

    step: int  # the step they close (the metrics line's "step")
    loss: float  # the mean over ranks
    stop: bool  # some rank asked to stop
    save: bool  # rank 0's clock says a save is due
    give_up: bool  # some rank's consecutive failed saves reached the limit
    skipped: bool  # an fp16 step skipped by the scaler: logged, never checked for anomalies
    record: dict[str, Any] | None  # rank 0's metrics line, waiting for its loss (None once written)


@dataclass
class _Facts:
    step: int
    skipped: bool
    record: dict[str, Any] | None
    sums: PendingSum


class Exchange:
    """At most one step's facts in flight: :meth:`start` at a step's end, :meth:`take` at the next."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._pending: _Facts | None = None
        self._peeked: Agreed | None = None

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def arrived(self) -> bool:
        """A step's facts are pending and their sum has arrived (reading it would not wait)."""
        return self._pending is not None and self._pending.sums.arrived()

    def start(self, step: int, loss: float, stop: bool, save: bool, give_up: bool, skipped: bool = False,
              record: dict[str, Any] | None = None) -> None:
        """Share step ``step``'s facts; the previous step's must have been taken (they travel in order)."""
        if self._pending is not None:
            raise RuntimeError(f"step {self._pending.step}'s shared facts were never read")
        sums = start_sum([loss, float(stop), float(save), float(give_up)])
        self._pending = _Facts(step, skipped, record, sums)

    def peek(self) -> Agreed | None:
        """The pending step's agreed facts without taking them (waits for the sum if it is still on the way)."""
        if self._pending is None:
            return None
        if self._peeked is None:
            facts = self._pending
            loss_sum, stops, saves, give_ups = facts.sums.result()
            self._peeked = Agreed(facts.step, loss_sum / self.world_size, stops > 0, saves > 0, give_ups > 0,
                                  facts.skipped, facts.record)
        return self._peeked

    def take(self) -> Agreed | None:
        """The pending step's agreed facts, which the caller now acts on; None when nothing is pending."""
        agreed = self.peek()
        self._pending = self._peeked = None
        return agreed
