"""Closing an optimizer step, mixed into :class:`~ckptrun.runtime.step.session.Run`: its metrics line, the
facts the ranks share about it, and the save or stop they agree on.

This is what every step pays for ckptrun, so it waits for nothing and shares
little: a step's facts join a batch that travels every N steps in one
all-gather the next step reads (:mod:`decisions`); the metrics lines of a
batch are one ``write`` to a file kept open (and rank 0 writes its own loss
as each step ends, one more ``write``, so that a crash before the batch is
shared still leaves the losses a resume is compared with: ``records.OWN_LOSSES``);
the heartbeat is one clock read
unless an interval has passed; the stop file, rank 0's save clock and the
save results are looked at once per batch. All facts so far are shared and
read at once — and waited for — only where every rank arrives at the same
step: before a save (so the snapshot's step has its line and its loss was
checked for anomalies), a stop, the end of the loop and ``finish``.
"""

from __future__ import annotations

import atexit
import sys
import time
from typing import TYPE_CHECKING, Any

import torch

from ckptrun.runtime import records
from ckptrun.runtime.step.decisions import SETTLED_FROM, WARMUP_BATCHES, Agreed, Exchange, choose_every
from ckptrun.runtime.step.reshard import note_global_batch


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
    _all_saving: bool

    if TYPE_CHECKING:  # provided by Run; stubs here would shadow them in the MRO
        def _refuse(self, message: str, code: int = ..., fatal: bool = ...) -> None: ...
        def _on_anomaly(self, reason: str, step: int) -> bool: ...
        def _settle_saves(self, wait: bool = False) -> None: ...
        def _stop_requested(self) -> bool: ...
        def _stop(self) -> None: ...
        def save(self) -> None: ...
        def _memory_save(self) -> None: ...
        def _watch_loss(self, step: int, loss: float, spiked: bool = ...) -> bool: ...
        def _blame_restored(self, step: int, loss: float, why: str | None = ...) -> None: ...
        def _check_replicas_between_saves(self) -> None: ...

    def _start_step_end(self, world_size: int) -> None:
        """Called once by ``Run.__init__``."""
        every = self.env.decision_every_steps
        self.exchange = Exchange(world_size, 1 if every == "auto" else every)
        self._warmup_times: list[float] | None = [] if every == "auto" else None  # auto: agreed s/step of the warm-up
        self.metrics_log = records.JsonlAppender(self.env.run_dir / records.METRICS)
        self.own_losses = records.JsonlAppender(self.env.run_dir / records.OWN_LOSSES)  # rank 0 only
        self._carried = (False, False)  # (stop, save) read from shared facts, to act on at the next boundary
        self._loaders: list[Any] = []  # tracked ckr.DataLoaders: a step commits what it consumed
        self.last_step_time = self._shared_at = time.monotonic()
        atexit.register(self._write_arrived_lines)

    def end_step(self, loss: float | torch.Tensor, skipped: bool = False, samples: int = 0, **metrics: Any) -> float:
        """Close an optimizer step: log it, share its facts, save on cadence, agree on stops; returns this rank's loss.

        A skipped step (fp16 overflow) is logged but does not advance the step counter.
        ``metrics`` (e.g. ``accuracy=``) are logged with the step. Its metrics line (the
        loss averaged over ranks), its anomaly check and a stop or time-based save it asks
        for are settled when its batch of facts is read — at most ``decision_every_steps``
        steps late, the same step on every rank. The agreed save and stop happen at the
        next step boundary (see :mod:`loop`), after the code that follows this call, or
        here when the loop has no boundaries.
        """
        for loader in self._loaders:
            loader.commit()  # this step consumed what the loop was handed
            if loader.saved_global_batch is not None and loader.step_samples:  # the first step since a restore
                note_global_batch(self, loader)
        missed = self._due is not None  # no boundary since the last step: close that one after this one
        local = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        if self.faults.nan_loss(self.step):
            local = float("nan")
        if self.exchange.pending and self._take_shared():
            return local  # a shared loss rolled the run back: this step is gone with it
        step = self.step + 1
        record = self._step_record(step, dict(metrics, skipped=skipped), samples) if self.rank == 0 else None
        if self.exchange.add(step, local, skipped, record):
            self._share()
        if skipped:
            return local
        if self.rank == 0:  # one O_APPEND write, no collective: a crash before the batch is shared keeps it
            self.own_losses.append({"step": step, "attempt": self.env.attempt, "loss": local, "own": True})
        self.step = step
        self.faults.after_optimizer_step(step, self.objects.get("model"))
        self.heart.beat(step, "train")
        stop, save = self._due or (False, False)
        self._due = (stop or self._carried[0], save or self._carried[1] or self.cadence.step_due(step))
        self._carried = (False, False)
        if missed or not self._defer:
            self._close_step()
        return local

    def _share(self) -> None:
        """Start sharing the open batch, with this rank's flags as they stand now (once per batch: they cost)."""
        self._settle_saves()
        now = time.monotonic()
        self.exchange.start(self._stop_requested(), self._time_to_save(), self.save_budget_spent is not None,
                            now - self._shared_at, saving=self.saver.busy())
        self._shared_at = now

    def _time_to_save(self) -> bool:
        """The clock part of the save cadence: rank 0's clock decides for every rank."""
        if self.rank != 0 or self.cadence.every_seconds is None:
            return False
        return self.cadence.time_due(time.monotonic(), self.last_save_time)

    def _settle_decisions(self) -> bool:
        """Share and act on every fact so far; only where every rank is at the same step (a save, a stop, the end
        of the loop, ``finish``): it may start a collective. True when a loss rolled the run back."""
        if self._take_shared():
            return True
        if not self.exchange.open:
            return False
        self._share()
        return self._take_shared()

    def _take_shared(self) -> bool:
        """Act on the batch in flight (every rank reads it at this point); True when a loss rolled the run back."""
        agreed = self.exchange.take()
        if agreed is None:
            return False
        if agreed.give_up:
            self._refuse(f"{self.save_budget_spent or 'saves failed on another rank'}; free disk space or fix the "
                         "checkpoint dir, then `ckptrun resume --latest`", 1)  # EXIT_FAILED, fatal: no restart onto a full disk
        self._carried = (self._carried[0] or agreed.stop, self._carried[1] or agreed.save)
        self._all_saving = agreed.all_saving
        self._tune_exchange(agreed)
        lines = []
        for facts in agreed.steps:
            if facts.record is not None:
                lines.append(self._line(facts))
            anomaly = None if facts.skipped else self.anomalies.check(facts.loss)  # judged against the restored window
            if not facts.skipped and self._watch_loss(facts.step, facts.loss, spiked=anomaly is not None):
                self.metrics_log.append_many(lines)  # poison (non-finite or a spike) right after a restore
                self._blame_restored(facts.step, facts.loss, anomaly)
            if anomaly is not None:
                self.metrics_log.append_many(lines)  # the anomalous step's line first, as the steps before it
                lines = []
                if self._on_anomaly(anomaly, facts.step):
                    self.exchange.open.clear()  # steps after it are gone with the rollback, on every rank alike
                    return True
        self.metrics_log.append_many(lines)
        return False

    def _tune_exchange(self, agreed: Agreed) -> None:
        """``decision_every_steps=auto``: N from agreed step times, so the same on every rank. First from the
        warm-up batches (every step), then larger whenever a batch's steps ask for a quarter more: a job's first
        steps are often slower than the rest (loader workers, allocator, compilation); never smaller, as a slow
        batch (an epoch's start, a save) is not the job's pace."""
        if self._warmup_times is None:
            return
        if len(self._warmup_times) < WARMUP_BATCHES:
            self._warmup_times.append(agreed.step_time_s)
            if len(self._warmup_times) < WARMUP_BATCHES:
                return
            settled = self._warmup_times[SETTLED_FROM - 1:]
            step_time, every = sorted(settled)[len(settled) // 2], choose_every(settled)
        else:
            step_time, every = agreed.step_time_s, choose_every([agreed.step_time_s])
            if every < self.exchange.every + max(1, self.exchange.every // 4):
                return
        self.exchange.every = every
        if self.rank == 0:
            records.log_event(self.env.run_dir, "decision_cadence", step=agreed.steps[-1].step, every_steps=every,
                              step_time_s=step_time)

    def _close_step(self) -> None:
        """What the ranks agreed: stop (emergency snapshot, exit 3) or save; then step faults."""
        stop, save = self._due or (False, False)
        self._due = None
        if stop or save:  # this step's own facts first: its line and anomaly check come before its snapshot
            self._settle_decisions()
            stop, self._carried = stop or self._carried[0], (False, False)
        if stop:
            self._stop()
        saving = save and self.saved_step != self.step  # the script may have called run.save() itself meanwhile
        if saving:
            self.save()  # compares the replicas itself
        elif self.memory.due(self.step) and self.saved_step != self.step:  # due for both: the durable save only
            self._memory_save()
        if not saving:
            self._check_replicas_between_saves()
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

    def _tell_applied_precision(self, step: int) -> None:
        """Once, at the first step record: a decided mixed mode whose autocast never ran is reported as the
        fp32 that ran (the ``precision`` event again, with the reason), never as the mode that was decided."""
        self.precision.told = True
        if self.precision.applied_mode == self.precision.mode:
            return
        reason = (f"{self.precision.mode} was decided, but the script never entered its autocast "
                  "(run.train_step applies it): it ran fp32")
        records.log_event(self.run_dir, "precision", requested=self.precision.decision.requested, mode="fp32",
                          decided=self.precision.mode, reason=reason, device=self.precision.device, step=step)
        print(f"ckptrun: precision fp32 ({reason})", file=sys.stderr, flush=True)

    def _step_record(self, step: int, metrics: dict[str, Any], samples: int) -> dict[str, Any]:
        """Rank 0's line for a step, built when it ends; its loss is filled in once the ranks' sum arrives."""
        now = time.monotonic()
        elapsed, self.last_step_time = now - self.last_step_time, now
        record = {"step": step, "attempt": self.env.attempt, "loss": None, "time": time.time(), "step_time_s": elapsed,
                  "precision": self.precision.applied_mode, "saving": self.saver.busy()}
        if not self.precision.told:
            self._tell_applied_precision(step)
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

    def _write_pending_line(self) -> None:
        """Before an injected fault: the lines of the batch in flight, as steps that ended before the failure have.
        Steps of the open batch have no mean loss yet: their lines come when a resume runs them again."""
        agreed = self.exchange.peek()  # waits for the rows, which every rank started: no peer is needed
        if agreed is not None:
            self.metrics_log.append_many([self._line(facts) for facts in agreed.steps if facts.record is not None])

    def _line(self, facts: Any) -> dict[str, Any]:
        """Rank 0's line of a step once its mean loss is agreed; handed out once."""
        record, facts.record = facts.record, None
        record["loss"] = facts.loss
        return record

    def _write_arrived_lines(self) -> None:
        """At exit without ``finish``: the lines of the batch in flight if its rows have arrived (never wait for a peer then)."""
        if self.exchange.arrived():
            self._write_pending_line()
        self.metrics_log.close()
        self.own_losses.close()
