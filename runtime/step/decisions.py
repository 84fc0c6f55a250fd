"""The facts all ranks must share, gathered every N steps in one collective that no step waits for.

Every step adds its facts — its loss, whether it was a skipped fp16 step,
rank 0's metrics line waiting for its mean loss — to an open batch. Every N
steps (``decision_every_steps``) the batch travels in one all-gather that the
step closing it *starts* (``async_op``), together with each rank's flags
sampled then: a stop asked (a stop file), a save due by its clock (only rank
0's counts), its save budget spent, its mean step time, and whether its saver
has a save in flight (``--save-overlap skip`` skips only when every rank's has). The step after
*reads* it, when the rows have long arrived behind that step's compute. A
batch is also shared and read at once where every rank arrives at the same
step — a save, a stop, the end of the loop, ``finish`` — so a snapshot never
precedes a line or an anomaly check of a step it holds. Ranks read at the
same point of the program, so every rank acts on the same decision at the
same step, and no rank ever waits on a collective the others skip. A stop
asked during step k is agreed at most N steps later (the batch's last step
plus one). Each rank sums the rows in rank order (Python floats: float64):
a step's mean loss is the same bits whatever N and however steps were
batched, and for two ranks the bits of a synchronous all-reduce. N costs one
collective per N steps instead of one per step: with gloo each costs
hundreds of microseconds of CPU on its threads, which on a machine without a
spare core come out of training. A world of one gathers nothing but keeps
the same timing, so a single-process run takes the decisions a multi-rank
run would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckptrun.runtime.collectives import PendingRows, start_gather


@dataclass
class StepFacts:
    """One step's facts; ``loss`` is this rank's until the batch is agreed, then the mean over ranks."""

    step: int  # the step they close (the metrics line's "step")
    loss: float
    skipped: bool  # an fp16 step skipped by the scaler: logged, never checked for anomalies
    record: dict[str, Any] | None  # rank 0's metrics line, waiting for its loss


@dataclass
class Agreed:
    """A batch of steps' facts as every rank sees them once gathered."""

    steps: list[StepFacts]  # in step order, each loss the mean over ranks
    stop: bool  # some rank asked to stop
    save: bool  # rank 0's clock says a save is due
    give_up: bool  # some rank's consecutive failed saves reached the limit
    step_time_s: float  # the ranks' mean seconds per step over the batch (chooses N)
    all_saving: bool = False  # every rank's saver had a save in flight (``--save-overlap skip`` skips only then)


@dataclass
class _InFlight:
    steps: list[StepFacts]
    rows: PendingRows


FLAGS = 5  # stop, save, give_up, seconds per step, saving: after the batch's losses
WARMUP_BATCHES = 10  # ``auto``: the first batches travel every step; their step times choose N (then each batch's)
SETTLED_FROM = 3  # ... from the third on (the first steps pay for warm-up: allocation, the precision report)
INTERVAL_S = 0.25  # ``auto``: at most one exchange per this much training (each costs ~0.5-1 ms of CPU with gloo)
MAX_EVERY = 32  # ``auto``: the most steps per batch, so decisions stay a few steps away on tiny steps


def choose_every(step_times_s: list[float]) -> int:
    """``auto``'s N from agreed seconds per step (identical on every rank, so is N): an exchange at most every
    ``INTERVAL_S`` of training, between 1 and ``MAX_EVERY`` steps."""
    ordered = sorted(step_times_s)
    typical = ordered[len(ordered) // 2] if ordered else 0.0
    return MAX_EVERY if typical <= 0 else max(1, min(MAX_EVERY, int(INTERVAL_S / typical)))


class Exchange:
    """An open batch of steps and at most one batch in flight: :meth:`start` it, :meth:`take` it at the next step."""

    def __init__(self, world_size: int, every: int = 1) -> None:
        self.world_size = world_size
        self.every = every  # steps per batch: the same on every rank
        self.open: list[StepFacts] = []
        self._pending: _InFlight | None = None
        self._peeked: Agreed | None = None

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def arrived(self) -> bool:
        """A batch is in flight and its rows have arrived (reading it would not wait)."""
        return self._pending is not None and self._pending.rows.arrived()

    def add(self, step: int, loss: float, skipped: bool = False, record: dict[str, Any] | None = None) -> bool:
        """A step's facts join the open batch; True when the batch is full (start it now)."""
        self.open.append(StepFacts(step, loss, skipped, record))
        return len(self.open) >= self.every

    def start(self, stop: bool, save: bool, give_up: bool, seconds: float = 0.0, saving: bool = False) -> None:
        """Share the open batch with this rank's flags and the ``seconds`` its steps took here; the batch in
        flight must have been taken (batches travel in order) and every rank starts the same batches."""
        if self._pending is not None:
            raise RuntimeError(f"the shared facts up to step {self._pending.steps[-1].step} were never read")
        steps, self.open = self.open, []
        values = [facts.loss for facts in steps]
        values += [float(stop), float(save), float(give_up), seconds / max(1, len(steps)), float(saving)]
        self._pending = _InFlight(steps, start_gather(values))

    def peek(self) -> Agreed | None:
        """The batch in flight, agreed, without taking it (waits for the rows if they are still on the way)."""
        if self._pending is None:
            return None
        if self._peeked is None:
            rows = self._pending.rows.result()
            sums = rows[0]
            for row in rows[1:]:  # rank order, left to right: the same bits on every rank
                sums = [a + b for a, b in zip(sums, row)]
            steps = self._pending.steps
            for facts, total in zip(steps, sums):
                facts.loss = total / self.world_size
            stop, _, give_up, seconds, saving = sums[-FLAGS:]
            self._peeked = Agreed(steps, stop > 0, rows[0][-FLAGS + 1] > 0, give_up > 0, seconds / self.world_size,
                                  all_saving=saving >= self.world_size)
        return self._peeked

    def take(self) -> Agreed | None:
        """The batch in flight, agreed, which the caller now acts on; None when nothing is in flight."""
        agreed = self.peek()
        self._pending = self._peeked = None
        return agreed
