"""Closing an optimizer step, mixed into :class:`~ckptrun.runtime.session.Run`: its metrics line, the
facts the ranks share about it, and the save or stop they agree on.

This is what every step pays for ckptrun, so it waits for nothing: step k's
facts travel in an all-reduce that step k+1 reads (:mod:`decisions`), the
metrics line is one ``write`` to a file kept open, the heartbeat one clock
read unless an interval has passed. A step's sums are read early — and
waited for — only where every rank arrives at the same step: before a save
(so the snapshot's step has its line and its loss was checked for
anomalies), a stop, the end of the loop and ``finish``.
"""

from __future__ import annotations

import atexit
import time
from typing import TYPE_CHECKING, Any

import torch

from ckptrun.runtime import records
from ckptrun.runtime.decisions import Agreed, Exchange


class StepEnd:
    """``end_step`` and the boundary after it: share, log, check, then save or stop where the ranks agreed."""

    step: int
    rank: int
    env: Any
    objects: dict[str, Any]
    faults: Any
    heart: Any
    cadence: Any
    saver: Any
    memory: Any  # runtime.memory_tier.MemoryTier
    precision: Any
    anomalies: Any
    save_budget_spent: str | None
    saved_step: int | None
    last_save_time: float
    _due: tuple[bool, bool] | None
    _defer: bool
    _lr_used: float | None

    if TYPE_CHECKING:  # provided by Run; stubs here would shadow them in the MRO
        def _refuse(self, message: str, code: int = ..., fatal: bool = ...) -> None: ...
        def _on_anomaly(self, reason: str, step: int) -> bool: ...
        def _settle_saves(self, wait: bool = False) -> None: ...
        def _stop_requested(self) -> bool: ...
        def _stop(self) -> None: ...
        def save(self) -> None: ...
        def _memory_save(self) -> None: ...

    def _start_step_end(self, world_size: int) -> None:
        """Called once by ``Run.__init__``."""
        self.exchange = Exchange(world_size)
        self.metrics_log = records.JsonlAppender(self.env.run_dir / records.METRICS)
        self._carried = (False, False)  # (stop, save) read from shared facts, to act on at the next boundary
        self._loaders: list[Any] = []  # tracked ckr.DataLoaders: a step commits what it consumed
        self.last_step_time = time.monotonic()
        atexit.register(self._write_arrived_line)

    def end_step(self, loss: float | torch.Tensor, skipped: bool = False, samples: int = 0, **metrics: Any) -> float:
        """Close an optimizer step: log it, share its facts, save on cadence, agree on stops; returns this rank's loss.

        A skipped step (fp16 overflow) is logged but does not advance the step counter.
        ``metrics`` (e.g. ``accuracy=``) are logged with the step. Its metrics line (the
        loss averaged over ranks), its anomaly check and a stop or time-based save it asks
        for are settled when the next step ends — one step late, the same step on every
        rank. The agreed save and stop happen at the next step boundary (see :mod:`loop`),
        after the code that follows this call, or here when the loop has no boundaries.
        """
        for loader in self._loaders:
            loader.commit()  # this step consumed what the loop was handed
        missed = self._due is not None  # no boundary since the last step: close that one after this one
        local = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        if self.faults.nan_loss(self.step):
            local = float("nan")
        if self._settle_decisions():
            return local  # the last step's loss rolled the run back: this step is gone with it
        step = self.step + 1
        record = self._step_record(step, dict(metrics, skipped=skipped), samples) if self.rank == 0 else None
        self._settle_saves()
        self.exchange.start(step, local, self._stop_requested(), self._time_to_save(), self.save_budget_spent is not None,
                            skipped, record)
        if skipped:
            return local
        self.step = step
        self.heart.beat(step, "train")
        stop, save = self._due or (False, False)
        self._due = (stop or self._carried[0], save or self._carried[1] or self.cadence.step_due(step))
        self._carried = (False, False)
        if missed or not self._defer:
            self._close_step()
        return local

    def _time_to_save(self) -> bool:
        """The clock part of the save cadence: rank 0's clock decides for every rank."""
        if self.rank != 0 or self.cadence.every_seconds is None:
            return False
        return self.cadence.time_due(time.monotonic(), self.last_save_time)

    def _settle_decisions(self) -> bool:
        """Act now on the last step's shared facts (every rank is at this point); True when they rolled the run back."""
        agreed = self.exchange.take()
        if agreed is None:
            return False
        if agreed.give_up:
            self._refuse(f"{self.save_budget_spent or 'saves failed on another rank'}; free disk space or fix the "
                         "checkpoint dir, then `ckptrun resume --latest`", 1)  # EXIT_FAILED: a restart may help
        self._write_line(agreed)
        self._carried = (self._carried[0] or agreed.stop, self._carried[1] or agreed.save)
        if agreed.skipped:
            return False
        anomaly = self.anomalies.check(agreed.loss)
        return anomaly is not None and self._on_anomaly(anomaly, agreed.step)

    def _close_step(self) -> None:
        """What the ranks agreed: stop (emergency snapshot, exit 3) or save; then step faults."""
        stop, save = self._due or (False, False)
        self._due = None
        if stop or save:  # this step's own facts first: its line and anomaly check come before its snapshot
            self._settle_decisions()
            stop, self._carried = stop or self._carried[0], (False, False)
        if stop:
            self._stop()
        if save and self.saved_step != self.step:  # the script may have called run.save() itself meanwhile
            self.save()
        elif self.memory.due(self.step) and self.saved_step != self.step:  # due for both: the durable save only
            self._memory_save()
        if self.faults.step_fault_due(self.step):
            self._write_pending_line()  # rank 0's line; a crashing rank's own step goes in its heartbeat
            if not self.faults.hang_due(self.step):  # a hung rank stays silent, as a real one would
                self.heart.beat(self.step, "train", force=True)
            self._settle_saves(wait=True)
            self.faults.after_step(self.step)

    def _rolled_back_at_end(self) -> bool:
        """At the end of a loop (every rank is there): the last step's facts; True when they rolled back."""
        return self._settle_decisions()

    # --- the metrics line -------------------------------------------------------------

    def _step_record(self, step: int, metrics: dict[str, Any], samples: int) -> dict[str, Any]:
        """Rank 0's line for a step, built when it ends; its loss is filled in once the ranks' sum arrives."""
        now = time.monotonic()
        elapsed, self.last_step_time = now - self.last_step_time, now
        record = {"step": step, "attempt": self.env.attempt, "loss": None, "time": time.time(), "step_time_s": elapsed,
                  "precision": self.precision.mode, "saving": self.saver.busy()}
        if samples and elapsed > 0:
            record["samples_per_s"] = samples / elapsed
        optimizer = self.objects.get("optimizer")
        if optimizer is not None:  # the rate this step used, not the one the scheduler set for the next
            record["lr"] = self._lr_used if self._lr_used is not None else float(optimizer.param_groups[0]["lr"])
        self._lr_used = None
        loader = self.objects.get("loader")
        if loader is not None and hasattr(loader, "global_batch"):
            record["epoch"] = loader.epoch
            record["samples_seen"] = loader.samples_seen
        record.update({k: float(v) if isinstance(v, torch.Tensor) else v for k, v in metrics.items() if v is not None})
        return record

    def _write_line(self, agreed: Agreed) -> None:
        if agreed.record is not None:
            agreed.record["loss"] = agreed.loss
            self.metrics_log.append(agreed.record)
            agreed.record = None

    def _write_pending_line(self) -> None:
        """Before an injected fault: the step's line, as a step that ended before the failure has one."""
        agreed = self.exchange.peek()  # waits for the sum, which every rank started: no peer is needed
        if agreed is not None:
            self._write_line(agreed)

    def _write_arrived_line(self) -> None:
        """At exit without ``finish``: the last step's line if its sum has arrived (never wait for a peer then)."""
        if self.exchange.arrived():
            self._write_pending_line()
        self.metrics_log.close()
