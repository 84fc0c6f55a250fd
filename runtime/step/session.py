"""The training script's handle on ckptrun: ``run = init()`` … ``run.finish()``.

A :class:`Run` owns the tracked state (model, optimizer, scheduler, scaler,
EMA, data loader, anything with ``state_dict``), the step counter, the save
cadence and the per-step decisions all ranks must share. Those decisions —
save now (clock-based, rank 0's clock), stop now (a stop request seen by any
rank) — ride with the steps' losses on one small all-gather every N steps
(``decision_every_steps``), started at the end of a step and read at the end
of the next (:mod:`step_end`, :mod:`decisions`), so ranks never disagree and
no step waits for it.

``Run`` is put together from one part per concern: this module holds its state,
tracking, the optimizer step and the way out (stop, finish); :mod:`loop` the
loop's two shapes, :mod:`step_end` closing a step, :mod:`restoring` resuming
from a snapshot, :mod:`rollback` the answer to an anomaly, :mod:`saving` saves
and their outcomes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ckptrun.runtime import collectives, records
from ckptrun.runtime.checkpoint import plain_state
from ckptrun.runtime.checkpoint.memory_tier import MemoryTier
from ckptrun.runtime.checkpoint.node_cache import NodeCache
from ckptrun.runtime.checkpoint.policies import AutoCadence, FailedSaves, Retention, SaveCadence
from ckptrun.runtime.checkpoint.saver import Saver
from ckptrun.runtime.checkpoint.wrappers import unwrap as _unwrap
from ckptrun.runtime.env import RunEnv
from ckptrun.runtime.faults import parse_faults
from ckptrun.runtime.step import hparams, reshard, stepper
from ckptrun.runtime.step import per_rank as rank_state
from ckptrun.runtime.step.anomaly import AnomalyDetector
from ckptrun.runtime.step.data import DataLoader
from ckptrun.runtime.step.exit_codes import EXIT_STOPPED, EXIT_UNRECOVERABLE
from ckptrun.runtime.step.loop import LoopShapes
from ckptrun.runtime.step.precision import Policy
from ckptrun.runtime.step.precision_report import REPORT, DtypeRecorder, write_report
from ckptrun.runtime.step.restoring import Restoring
from ckptrun.runtime.step.rollback import Rollback
from ckptrun.runtime.step.saving import Saving
from ckptrun.runtime.step.safeguards import Safeguards
from ckptrun.runtime.step.step_end import StepEnd
from ckptrun.runtime.storage.remote_store import open_store
from ckptrun.runtime.worker.fault_injection import FaultInjector
from ckptrun.runtime.worker.liveness import Heartbeater

def _code_version() -> str:
    try:
        return hashlib.sha256(Path(sys.argv[0]).read_bytes()).hexdigest()[:16]
    except OSError:
        return ""


class Run(LoopShapes, StepEnd, Restoring, Rollback, Saving, Safeguards):
    """State, counters and policy of one training process. Create it with :func:`init`."""

    owns_group = True  # init() created the default process group (False: the script did; finish() leaves it)
    per_rank_names: frozenset[str] = frozenset()  # tracked with per_rank=True: stored in each rank's own files
    _checked_models: frozenset[str] = frozenset()  # trained models already compared across ranks at track()
    unsynchronised = False  # several ranks, trained models, none wrapped in DDP/FSDP: nothing syncs gradients
    checked_replicas = False  # the first save compares the shared objects' tensors across ranks (per_rank)

    def __init__(self, env: RunEnv, config: dict[str, Any], precision: Policy) -> None:
        self.env = env
        self.precision = precision
        self.scaler = precision.make_scaler()
        self.anomalies = AnomalyDetector(env.anomaly_window, env.anomaly_sigma)
        self.rollbacks = 0  # this run's, as of the last rollback (counted from the record: see step.rollback)
        self.lr_scale = 1.0  # the learning rate's lowering by rollbacks, as the state holds it (saved with it)
        self._precision_reported = False
        self.config = dict(config)
        self.rank, self.world_size = collectives.rank(), collectives.world_size()
        self.device = collectives.worker_device()  # where the script puts its model: LOCAL_RANK's GPU, or the CPU
        self.run_dir = env.run_dir
        self.ckpt_dir = env.checkpoint_dir
        self.step = 0
        self.epoch = 0
        self.total_steps: int | None = None
        self.changed: dict[str, tuple[Any, Any]] = {}  # config keys that differ from the restored snapshot's: (old, new)
        self._due: tuple[bool, bool] | None = None  # (stop, save) agreed at the last end_step, not yet done
        self._defer = False  # the loop has per-step boundaries: close steps there, after the user's code
        self._lr_used: float | None = None  # the lr the last optimizer step used (its pre-hook saw it)
        self._loaders_checked = False
        self.objects: dict[str, Any] = {}
        self.auto = AutoCadence(env.mtbf_seconds, env.save_interval_cap_seconds) if env.save_every_auto else None
        self.cadence = SaveCadence(env.save_every_steps, self.auto.interval if self.auto else env.save_every_seconds)
        self.retention = Retention(env.keep_last, env.keep_every)
        self.failed_saves = FailedSaves(env.max_failed_saves)
        self.faults = FaultInjector(parse_faults(env.fault), self.rank, env.attempt, self.run_dir)
        self.faults.arm_timers()
        self.heart = Heartbeater(self.run_dir, self.rank, env.attempt, env.heartbeat_interval)
        self.saver = Saver(self.ckpt_dir, env.hash_algorithm, env.async_save, env.save_overlap,
                           remote=open_store(env.ckpt_url, env.storage_options, env.run_id) if env.ckpt_url else None,
                           keep_local=env.local_cache,
                           node_cache=NodeCache.for_rank(env.node_cache_dir, env.keep_last, self.run_dir))
        self.memory = MemoryTier(env, self.run_dir)  # off unless the supervisor named a memory directory
        self.published: str | None = None
        self.save_budget_spent: str | None = None
        self.code_version = _code_version()
        self.lineage = ""
        self.world_history = reshard.history(None, self.world_size, 0)
        self.parent: str | None = None
        self.last_save_time = time.monotonic()
        self._stop_path = str(self.run_dir / "stop")  # checked once per batch of facts: os.access is cheapest
        self._start_step_end(self.world_size)
        self.saved_step: int | None = None
        self.restored_from: Path | None = None
        self._start_safeguards()

    # --- registration -----------------------------------------------------------

    def track(self, per_rank: bool = False, **objects: Any) -> None:
        """Register everything that must survive a restart: objects with state_dict/load_state_dict,
        ``ckr.Value(x)`` for one plain value, or a dict of JSON-able values. ``per_rank=True``: each rank
        stores and restores its own copy (:mod:`ckptrun.runtime.step.per_rank`)."""
        if per_rank:
            self.per_rank_names = self.per_rank_names | {name for name, obj in objects.items() if obj is not None}
        if self.scaler is not None and "scaler" not in objects and "scaler" not in self.objects:
            objects = {**objects, "scaler": self.scaler}
        for name, obj in objects.items():
            if obj is None:
                continue
            if name == "scaler":
                self.scaler = obj
            obj = plain_state.trackable(name, obj)  # a dict of plain values (ckr.Value is a state_dict object)
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                hint = " (use ckptrun.runtime.DataLoader for a resumable data position)" if isinstance(obj, torch.utils.data.DataLoader) else plain_state.hint(obj)
                raise TypeError(f"track({name}=...): {type(obj).__name__} has no state_dict/load_state_dict{hint}")
            if isinstance(obj, DataLoader):
                obj.before_batch = self._boundary
            if name == "optimizer" and isinstance(obj, torch.optim.Optimizer):
                obj.register_step_pre_hook(self._note_lr)
            self.objects[name] = obj
        self._loaders = [obj for obj in self.objects.values() if isinstance(obj, DataLoader)]
        self._find_per_rank_models()

    def _find_per_rank_models(self) -> None:
        """A trained model that differs across ranks as it is tracked is each rank's own (see :mod:`per_rank`);
        once per model, when its optimizer is tracked too. Collective: every rank tracks the same names."""
        shared = self._shared_objects()
        unchecked = {name: module for name, module in rank_state.trained_modules(shared).items()
                     if name not in self._checked_models}
        self._checked_models |= set(unchecked)
        trained = rank_state.trained_modules(self.objects).values()
        self.unsynchronised = self.world_size > 1 and bool(trained) and not any(map(rank_state.synchronised, trained))
        differ = rank_state.differing_models(unchecked)
        own = [self.objects[n] for n in self.per_rank_names | set(differ) if isinstance(self.objects[n], torch.nn.Module)]
        added = (set(differ) | set(rank_state.optimizers_of(shared, own))) - self.per_rank_names
        if not added:
            return
        self.per_rank_names = self.per_rank_names | added
        if differ and self.rank == 0 and not records.read_events(self.run_dir, "per_rank_state"):  # once a run
            records.log_event(self.run_dir, "per_rank_state", objects=sorted(added), cause="differ when tracked")
            note = rank_state.per_rank_note(sorted(differ), sorted(added - set(differ)))
            print(f"ckptrun: {note}", file=sys.stderr, flush=True)

    def _shared_objects(self) -> dict[str, Any]:
        """The tracked objects every rank holds alike (the snapshot's shared state): all but the per-rank ones."""
        return {name: obj for name, obj in self.objects.items() if name not in self.per_rank_names}

    def _note_lr(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        self._lr_used = float(optimizer.param_groups[0]["lr"])

    def set_lr(self, lr: float) -> None:
        """Make ``lr`` the base learning rate of every param group and of the scheduler (see :mod:`hparams`).

        Call it after :meth:`restore`, e.g. when ``"lr" in run.changed``: the restored
        optimizer and scheduler would otherwise bring back the snapshot's rate.
        """
        hparams.set_lr(self.objects["optimizer"], self.objects.get("scheduler"), lr)

    def _refuse(self, message: str, code: int = EXIT_UNRECOVERABLE, fatal: bool = True) -> None:
        """Stop this worker; with ``fatal`` the supervisor will not retry."""
        if fatal and self.rank == 0:
            records.write_fatal(self.run_dir, self.rank, message, code)
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(code)

    # --- the training loop ----------------------------------------------------

    def train_step(self, micro_batches: Sequence[Any], forward: Callable[[Any], Any],
                   loss: Callable[[Any, Any], torch.Tensor] | None = None, max_norm: float | None = None,
                   metrics: Callable[[Any, Any], dict[str, Any]] | None = None) -> float:
        """One optimizer step over ``micro_batches`` under the precision policy; returns this rank's mean
        loss over its micro-batches (``metrics.jsonl`` logs the mean over ranks, see :meth:`end_step`).

        ``forward(batch)`` runs under autocast; ``loss(outputs, batch)``, if given, runs
        outside it on fp32 outputs (else ``forward`` returns the loss itself).
        ``metrics(outputs, batch)`` returns custom metrics (``{"accuracy": ...}``), averaged
        over the micro-batches and logged with the step.
        Accumulation divides by the micro-batch count and lets DDP synchronise the
        last one only; a skipped fp16 step advances neither scheduler, EMA nor step.
        """
        self._boundary()
        model, optimizer = self.objects["model"], self.objects["optimizer"]
        recorder = self._precision_recorder()
        with recorder if recorder is not None else contextlib.nullcontext():
            value, custom = stepper.accumulate(model, micro_batches, forward, loss, self.precision, self.scaler,
                                               before_micro=self._micro_fault, measure=metrics)
            self.faults.after_backward(self.step, model)
            if recorder is not None:
                recorder.phase = "optimizer"
                recorder.note_gradients([p for g in optimizer.param_groups for p in g["params"]])
            stats = stepper.optimizer_step(model, optimizer, self.scaler, max_norm,
                                           count_zeros=self.precision.autocast_dtype is not None
                                           and stepper.zero_count_due(self.step, self.exchange.every))
        if recorder is not None:
            write_report(self.run_dir, self.precision.decision, recorder, list(model.parameters()), optimizer)
        if not stats.skipped:
            self._advance_schedules(model)
        optimizer.zero_grad(set_to_none=True)
        count = len(micro_batches) * getattr(self.objects.get("loader"), "micro_samples", 0)
        return self.end_step(value, samples=count, **{**custom, **stats.metrics()})

    def _micro_fault(self, index: int) -> None:
        if self.faults.step_fault_due(self.step, index):
            self._write_pending_line()
            self._settle_saves(wait=True)
            self.faults.inside_step(self.step, index)

    def _precision_recorder(self) -> DtypeRecorder | None:
        """Rank 0 records op dtypes during its first step of a run (precision.json)."""
        if self.rank != 0 or self._precision_reported:
            return None
        self._precision_reported = True
        return None if (self.run_dir / REPORT).exists() else DtypeRecorder()

    def _advance_schedules(self, model: Any) -> None:
        scheduler, ema = self.objects.get("scheduler"), self.objects.get("ema")
        if scheduler is not None:
            scheduler.step()
        if ema is not None and hasattr(ema, "update_parameters"):
            ema.update_parameters(_unwrap(model))

    # --- stopping -------------------------------------------------------------

    def _stop_requested(self) -> bool:
        return os.access(self._stop_path, os.F_OK)

    def _stop(self) -> None:
        """Agreed stop: emergency snapshot at this boundary (unless just saved), wait for it, then exit 3."""
        self._final_save()
        if self.rank == 0:
            records.log_event(self.run_dir, "stopped", step=self.step, attempt=self.env.attempt)
        self.heart.beat(self.step, "done")
        self._exit_quietly(EXIT_STOPPED)

    def _final_save(self) -> None:
        """Wait for the in-flight save; save this step unless it is saved; wait for that too."""
        self._settle_saves(wait=True)
        self._finishing = True  # a final save is never skipped for overlap
        if self.saved_step != self.step and self.step > 0:
            self.save()
            self._settle_saves(wait=True)
        self.saver.empty_staging()  # staging without --local-cache ends empty, a restored copy included

    def _exit_quietly(self, code: int) -> None:
        """Leave after the ranks agree, without running the rest of the user's script."""
        collectives.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def finish(self) -> None:
        """End of training: a final snapshot (unless this step is saved), completion event, leave the group."""
        self._settle_decisions()  # the last step's line and anomaly check
        self._carried = (False, False)  # a stop asked at the last step is moot: the run is complete
        if self._due is not None:  # the last step's save and faults; a stop asked then is moot: the run is complete
            self._due = (False, self._due[1])
            self._close_step()
        self._require_finite_end()
        self._final_save()
        self._require_final_snapshot()
        self.saver.close()
        self.memory.close()
        if self.rank == 0:
            records.log_event(self.run_dir, "completed", step=self.step, attempt=self.env.attempt)
        self.metrics_log.close()
        self.own_losses.close()
        self.heart.beat(self.step, "done")
        if collectives.active():
            dist.barrier()
            if self.owns_group:
                dist.destroy_process_group()
