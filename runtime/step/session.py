"""The training script's handle on ckptrun: ``run = init()`` … ``run.finish()``.

A :class:`Run` owns the tracked state (model, optimizer, scheduler, scaler,
EMA, data loader, anything with ``state_dict``), the step counter, the save
cadence and the per-step decisions all ranks must share. Those decisions —
save now (clock-based, rank 0's clock), stop now (a stop request seen by any
rank) — ride on one small all-reduce together with the step's loss, started
at the end of a step and read at the end of the next (:mod:`step_end`,
:mod:`decisions`), so ranks never disagree and no step waits for it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ckptrun.runtime import collectives, records

from ckptrun.runtime.step import hparams, per_rank, reshard, rng, stepper

from ckptrun.runtime.checkpoint import snapshot, tiering, train_state

from ckptrun.runtime.storage import store

from ckptrun.runtime.worker import timeline
from ckptrun.runtime.step.anomaly import AnomalyDetector
from ckptrun.runtime.step.data import DataLoader
from ckptrun.runtime.env import RunEnv
from ckptrun.runtime.worker.fault_injection import FaultInjector
from ckptrun.runtime.faults import parse_faults
from ckptrun.runtime.worker.liveness import Heartbeater
from ckptrun.runtime.step.loop import LoopShapes, untracked_loader_in_use
from ckptrun.runtime.step.step_end import StepEnd
from ckptrun.runtime.checkpoint.policies import AutoCadence, FailedSaves, Retention, SaveCadence, refused_changes
from ckptrun.runtime.storage.remote_store import open_store
from ckptrun.runtime.checkpoint.retention import apply_retention
from ckptrun.runtime.step.precision import Policy
from ckptrun.runtime.checkpoint.saver import Saver
from ckptrun.runtime.checkpoint.memory_tier import MemoryTier
from ckptrun.runtime.step.precision_report import REPORT, DtypeRecorder, write_report
from ckptrun.runtime.checkpoint.verify import newest_verified
from ckptrun.runtime.checkpoint.wrappers import unwrap as _unwrap

EXIT_FAILED, EXIT_STOPPED, EXIT_UNRECOVERABLE = 1, 3, 4


def _process_start_time() -> float:
    import psutil

    return psutil.Process().create_time()


def _code_version() -> str:
    try:
        return hashlib.sha256(Path(sys.argv[0]).read_bytes()).hexdigest()[:16]
    except OSError:
        return ""


class Run(LoopShapes, StepEnd):
    """State, counters and policy of one training process. Create it with :func:`init`."""

    owns_group = True  # init() created the default process group (False: the script did; finish() leaves it)
    per_rank_names: frozenset[str] = frozenset()  # tracked with per_rank=True: stored in each rank's own files
    checked_replicas = False  # the first save compares the shared objects' tensors across ranks (per_rank)

    def __init__(self, env: RunEnv, config: dict[str, Any], precision: Policy) -> None:
        self.env = env
        self.precision = precision
        self.scaler = precision.make_scaler()
        self.anomalies = AnomalyDetector(env.anomaly_window, env.anomaly_sigma)
        self.rollbacks = 0
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
                           keep_local=env.local_cache)
        self.memory = MemoryTier(env, self.run_dir)  # off unless the supervisor named a memory directory
        self.published: str | None = None
        self.save_budget_spent: str | None = None
        self.code_version = _code_version()
        self.lineage = ""
        self.world_history = reshard.history(None, self.world_size, 0)
        self.parent: str | None = None
        self.last_save_time = time.monotonic()
        self._stop_path = str(self.run_dir / "stop")  # checked every step: os.access is the cheapest test
        self._start_step_end(self.world_size)
        self.saved_step: int | None = None
        self.restored_from: Path | None = None

    # --- registration and restore ------------------------------------------

    def track(self, per_rank: bool = False, **objects: Any) -> None:
        """Register everything that must survive a restart (each needs state_dict/load_state_dict).
        ``per_rank=True``: each rank stores and restores its own copy (:mod:`ckptrun.runtime.step.per_rank`)."""
        if per_rank:
            self.per_rank_names = self.per_rank_names | {name for name, obj in objects.items() if obj is not None}
        if self.scaler is not None and "scaler" not in objects and "scaler" not in self.objects:
            objects = {**objects, "scaler": self.scaler}
        for name, obj in objects.items():
            if obj is None:
                continue
            if name == "scaler":
                self.scaler = obj
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                hint = " (use ckptrun.runtime.DataLoader for a resumable data position)" if isinstance(obj, torch.utils.data.DataLoader) else ""
                raise TypeError(f"track({name}=...): {type(obj).__name__} has no state_dict/load_state_dict{hint}")
            if isinstance(obj, DataLoader):
                obj.before_batch = self._boundary
            if name == "optimizer" and isinstance(obj, torch.optim.Optimizer):
                obj.register_step_pre_hook(self._note_lr)
            if isinstance(obj, torch.optim.Optimizer):
                self.saver.guard(obj)
                self.memory.guard(obj)
            self.objects[name] = obj
        self._loaders = [obj for obj in self.objects.values() if isinstance(obj, DataLoader)]

    def _note_lr(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        self._lr_used = float(optimizer.param_groups[0]["lr"])

    def set_lr(self, lr: float) -> None:
        """Make ``lr`` the base learning rate of every param group and of the scheduler (see :mod:`hparams`).

        Call it after :meth:`restore`, e.g. when ``"lr" in run.changed``: the restored
        optimizer and scheduler would otherwise bring back the snapshot's rate.
        """
        hparams.set_lr(self.objects["optimizer"], self.objects.get("scheduler"), lr)

    def restore(self) -> int:
        """Load the snapshot this attempt resumes from, if any; returns the step to continue from.

        Supervised: exactly the snapshot named in C1 (the supervisor verified it);
        if it does not load, this attempt fails. Otherwise rank 0 verifies and
        picks the newest snapshot of the lineage, falling back to older ones that
        verify when one does not load, and says why.
        """
        self.heart.beat(self.step, "restore")
        skipped: set[str] = set()
        while True:
            chosen = self._choose_snapshot(skipped)
            if chosen is None:
                if self.env.exit_after_restore:
                    self._refuse(f"probe: no verified snapshot in {self.ckpt_dir} to restore", 2, fatal=False)
                if skipped:
                    self._refuse(f"no snapshot in {self.ckpt_dir} loads (tried {', '.join(sorted(skipped))}); "
                                 f"inspect them with `ckptrun verify {self.ckpt_dir}`")
                return self.step
            started = time.monotonic()
            self._check_compatible(snapshot.read_manifest(chosen))
            try:
                loaded = self._load(chosen)
            except snapshot.LoadError as exc:
                self._restore_failed(chosen, str(exc))
                skipped.add(chosen.name)
                continue
            self._apply(loaded)
            self.restored_from, self.parent, self.saved_step = chosen, chosen.name, self.step
            if self.memory.holds(chosen):  # not durable: the next save's parent is its durable one, and a stop saves
                self.parent, self.saved_step = loaded.manifest.parent, None
            if self.rank == 0:
                records.log_event(self.run_dir, "probe_restored" if self.env.exit_after_restore else "restored",
                                  attempt=self.env.attempt, snapshot=str(chosen), step=self.step,
                                  seconds=time.monotonic() - started, bytes=loaded.manifest.total_bytes,
                                  since_process_start=time.time() - _process_start_time(),
                                  startup={"process": _process_start_time(), **timeline.MARKS},
                                  verified_by="as loaded" if loaded.manifest.verified_as_loaded else
                                  "supervisor" if self.env.resume_from else "runtime",
                                  tier="memory" if self.memory.holds(chosen) else "disk")
            if self.env.exit_after_restore:
                self._exit_quietly(0)
            return self.step

    def _restore_failed(self, path: Path, reason: str) -> None:
        self._note_unloadable(path, reason)
        if self.env.resume_from is not None:
            self._refuse(f"snapshot {path} named for this attempt does not load: {reason}", EXIT_FAILED, fatal=False)

    def _choose_snapshot(self, skipped: set[str]) -> Path | None:
        if self.env.resume_from is not None:
            return self.env.resume_from
        if self.env.supervised:
            return None
        return self._newest_verified(skipped)

    def _newest_verified(self, skipped: set[str]) -> Path | None:
        """Rank 0 verifies and picks, every rank gets its choice (ranks must agree on what they load)."""
        choice = None
        if self.rank == 0 and self.saver.remote is not None:  # an object store: its manifests decide (runtime.tiering)
            found = tiering.choose_for_worker(self.saver.remote, self.ckpt_dir, self.run_dir, skipped,
                                              log=lambda line: print(f"ckptrun: {line}", file=sys.stderr))
            choice = str(found) if found else None
        elif self.rank == 0:
            report = newest_verified(self.ckpt_dir, log=lambda line: print(f"ckptrun: {line}", file=sys.stderr), skip=skipped,
                                     at_load=True)  # chunked snapshots: sizes here, every byte verified as loaded
            choice = str(report.path) if report else None
        choice = collectives.broadcast_object(choice)
        return Path(choice) if choice else None

    def _note_unloadable(self, path: Path, reason: str) -> None:
        if self.rank == 0:
            records.log_event(self.run_dir, "restore_failed", attempt=self.env.attempt, snapshot=str(path), reason=reason)
            print(f"ckptrun: snapshot {path.name} does not load: {reason}", file=sys.stderr, flush=True)

    def _load_newest(self) -> tuple[Path, snapshot.Loaded] | None:
        """The newest verified snapshot that loads; those that verify but do not load are reported and skipped."""
        skipped: set[str] = set()
        while (path := self._newest_verified(skipped)) is not None:
            try:
                return path, self._load(path)
            except snapshot.LoadError as exc:  # raised on every rank alike
                self._note_unloadable(path, str(exc))
                skipped.add(path.name)
        return None

    def _load(self, path: Path) -> snapshot.Loaded:
        """Load a snapshot; one written at another world size brings no per-rank files (see :mod:`reshard`)."""
        return snapshot.load(path, rank_files=snapshot.read_manifest(path).world_size == self.world_size,
                             live=train_state.live_tensors(self.objects))

    def _check_compatible(self, manifest: snapshot.Manifest) -> None:
        if manifest.world_size != self.world_size and not self.env.allow_reshard:
            self._refuse(reshard.refusal(manifest, self.world_size))
        changed = refused_changes(manifest.config, self.config, self.env.allow_changes)
        if changed:
            detail = ", ".join(f"{k}: {manifest.config.get(k)!r} -> {self.config.get(k)!r}" for k in changed)
            self._refuse(f"config changed since snapshot step {manifest.step} ({detail}); "
                         f"allow it with --allow-change {','.join(changed)} or start a new run")
        self.changed = hparams.config_changes(manifest.config, self.config)
        if self.changed and self.rank == 0:
            records.log_event(self.run_dir, "config_changed", step=manifest.step, changed=self.changed)
            detail = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in self.changed.items())
            print(f"ckptrun: config changed since snapshot step {manifest.step}: {detail}", file=sys.stderr, flush=True)
        if manifest.code_version and manifest.code_version != self.code_version and self.rank == 0:
            records.log_event(self.run_dir, "code_changed", snapshot_code=manifest.code_version, code=self.code_version)
            print(f"ckptrun: note: the training script changed since snapshot step {manifest.step}", file=sys.stderr)

    def _apply(self, loaded: snapshot.Loaded) -> None:
        tree = loaded.shared_tree
        for name in self._shared_objects():
            if name not in tree["objects"]:
                self._refuse(f"snapshot has no state for {name!r} (tracked now, not when it was saved)")
        train_state.apply(self._shared_objects(), tree["objects"], loaded.shared_tensors)
        if loaded.rank_tree and (missing := per_rank.restore({n: self.objects[n] for n in self.per_rank_names},
                                                              loaded.rank_tree, loaded.rank_tensors)):
            self._refuse(f"snapshot has no per-rank state for {', '.join(map(repr, missing))} (tracked now, not when it was saved)")
        self.step = tree["counters"]["step"]
        self.epoch = tree["counters"].get("epoch", 0)
        self.rollbacks = tree["counters"].get("rollbacks", 0)
        if not loaded.rank_tree:  # written at another world size: per-rank state does not carry over
            reshard.reseed(self.env.seed, self.step, self.rank)
            reshard.record(self, loaded.manifest)
        elif not self.faults.has("skip-rng-restore"):
            rng.restore(loaded.rank_tree["rng"], loaded.rank_tensors)
        self.world_history = reshard.history(loaded.manifest, self.world_size, self.step)
        self.lineage = store.read_lineage(self.ckpt_dir).current if store.read_lineage(self.ckpt_dir) else loaded.manifest.lineage

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
                                           count_zeros=self.precision.autocast_dtype is not None)
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

    # --- anomalies ----------------------------------------------------------------

    def _on_anomaly(self, reason: str, step: int) -> bool:
        """Apply --on-anomaly to step ``step``'s loss; True when the run was rolled back (its counters are the snapshot's)."""
        policy = self.env.on_anomaly
        if self.rank == 0:
            records.log_event(self.run_dir, "anomaly", step=step, reason=reason, policy=policy)
            print(f"ckptrun: anomaly at step {step}: {reason} (policy: {policy})", file=sys.stderr, flush=True)
        if policy == "stop":
            self._refuse(f"anomaly at step {step}: {reason}; stopped without saving the suspect state "
                         "(use --on-anomaly rollback to recover automatically)")
        if policy == "rollback":
            self._rollback(reason, step)
            return True
        return False

    def _rollback(self, reason: str, from_step: int) -> None:
        """Restore the previous verified snapshot in-process, fork the lineage, lower the LR, skip the data window."""
        if self.rollbacks >= self.env.max_rollbacks:
            self._refuse(f"anomaly after {self.rollbacks} rollbacks ({reason}); lower the learning rate or inspect the data")
        self._settle_saves(wait=True)
        found = self._load_newest()
        if found is None:
            self._refuse(f"anomaly ({reason}) and no verified snapshot that loads to roll back to")
        loader = self.objects.get("loader")
        position = loader.state_dict() if loader is not None else None  # skip the window that caused it
        path, loaded = found
        self._apply(loaded)
        if loader is not None:
            loader.load_state_dict(position)
        if self.rank == 0:
            store.fork(self.ckpt_dir, path)
        collectives.barrier()
        self.lineage, self.parent, self.saved_step = store.read_lineage(self.ckpt_dir).current, path.name, self.step
        self.rollbacks += 1
        factor = self.env.rollback_lr_factor
        hparams.scale_lr(self.objects.get("optimizer"), self.objects.get("scheduler"), factor)
        self.anomalies.history.clear()
        if self.rank == 0:
            records.log_event(self.run_dir, "rollback", from_step=from_step, to_step=self.step, snapshot=str(path),
                              lr_factor=factor, rollbacks=self.rollbacks, reason=reason)

    # --- saving -----------------------------------------------------------------

    def save(self) -> None:
        """Snapshot the whole state at this step boundary; async saves return once the state is staged."""
        if self._settle_decisions():  # the step's line and anomaly check come first (every rank is here)
            return  # rolled back: the state is a verified snapshot's
        self.heart.beat(self.step, "save")
        self._check_loaders()
        step, started = self.step, time.monotonic()
        if not (self.saver.busy() and self.env.save_overlap == "skip"):
            self._settle_saves(wait=True)  # at most one in flight; its outcome names the next parent
        if self.save_budget_spent is not None:  # every rank settled the same results: they agree here
            self._refuse(f"{self.save_budget_spent}; free disk space or fix the checkpoint dir, "
                         "then `ckptrun resume --latest`", EXIT_FAILED)
        waited = time.monotonic() - started
        if waited > 0.001 and self.rank == 0:
            records.log_event(self.run_dir, "save_waited", step=step, seconds=waited)
        self.saver.begin(self._collect(), self._info(), fault=lambda phase: self.faults.during_save(step, phase),
                         on_result=self._on_save_result, waited=waited)
        if self.auto is not None:
            self.auto.started()
            self.cadence = replace(self.cadence, every_seconds=self.auto.interval)
        self.last_save_time = time.monotonic()
        self.saved_step, self.parent = step, store.snapshot_name(step)
        self._settle_saves(wait=not self.env.async_save)
        self.heart.beat(self.step, "train")

    def _memory_save(self) -> None:
        """A memory-tier snapshot at this step boundary (the memory cadence agreed by step number)."""
        if self._settle_decisions():  # the step's line and anomaly check first, as for a durable save
            return
        self.heart.beat(self.step, "save")
        self.memory.save(self._collect(), self._info())
        self.heart.beat(self.step, "train")

    def _check_loaders(self) -> None:
        """Once, at the first save: warn when a torch DataLoader is in use but its position is not tracked."""
        if not self._loaders_checked and self.rank == 0 and untracked_loader_in_use(self.objects.values()):
            print("ckptrun: warning: data position not saved: a resume restarts this epoch (track the loader: "
                  "ckr.DataLoader or torchdata's StatefulDataLoader, run.track(loader=...))", file=sys.stderr, flush=True)
        self._loaders_checked = True

    def _on_save_result(self, result: snapshot.SaveResult) -> None:
        """Every rank, on the thread that finished the save: rank 0 records it and applies retention."""
        if self.rank != 0:
            return
        if result.ok:
            seconds = result.persist_s + result.publish_s
            records.log_event(self.run_dir, "snapshot_saved", step=result.step, path=str(result.path), bytes=result.bytes,
                              stall_s=result.stall_s, waited_s=result.waited_s, write_s=seconds,
                              persist_s=result.persist_s, publish_s=result.publish_s, asynchronous=result.asynchronous,
                              throughput_mb_s=result.bytes / seconds / 1e6 if seconds else None,
                              staging_allocated_bytes=result.staging_allocated_bytes,
                              rss_after_stage_bytes=result.rss_after_stage_bytes,
                              staged_bytes_per_rank=list(result.staged_bytes_per_rank),
                              staging_allocated_bytes_per_rank=list(result.allocated_bytes_per_rank),
                              remote=result.remote, upload_s=result.upload_s)
            if result.stale_of is not None:
                records.log_event(self.run_dir, "stale_staging", step=result.step, same_as_step=result.stale_of)
                print(f"ckptrun: warning: snapshot step {result.step} holds exactly the tensors of step {result.stale_of}: "
                      "stale staging, or training changed nothing", file=sys.stderr, flush=True)
            apply_retention(self.ckpt_dir, self.retention, self.run_dir, self.env.paranoid_retention, self.saver.remote)
        else:
            records.log_event(self.run_dir, "save_skipped" if result.skipped else "save_failed", step=result.step, error=result.error)
            print(f"ckptrun: SAVE FAILED at step {result.step}: {result.error}", file=sys.stderr, flush=True)

    def _settle_saves(self, wait: bool = False) -> None:
        """Account for finished saves: the parent of the next one, and the consecutive-failure budget."""
        self.memory.settle(wait)
        for result in self.saver.collect(wait):
            if result.ok:
                self.published = result.path.name  # type: ignore[union-attr]
            elif self.saved_step == result.step:
                self.saved_step, self.parent = None, self.published
            if self.failed_saves.record(result.ok):
                self.save_budget_spent = f"{self.failed_saves.consecutive} consecutive saves failed (last: {result.error})"
            if self.rank == 0:
                self._retune(result)

    def _retune(self, result: snapshot.SaveResult) -> None:
        """``--save-every auto`` on rank 0 (whose clock decides, shared by the step's all-reduce): the time
        between saves follows Daly from this save's cost δ — the stall of an async save, the whole sync one."""
        auto, change = self.auto, None
        if auto is None:
            return
        if result.ok:
            change = auto.measured(result.stall_s + (0.0 if result.asynchronous else result.persist_s + result.publish_s))
        else:
            auto.failed()
        self.cadence = replace(self.cadence, every_seconds=auto.interval)
        if change is not None:
            records.log_event(self.run_dir, "cadence", step=self.step, attempt=self.env.attempt, **change)

    def _shared_objects(self) -> dict[str, Any]:
        return {name: obj for name, obj in self.objects.items() if name not in self.per_rank_names}

    def _collect(self) -> snapshot.State:
        if not self.checked_replicas:
            self.checked_replicas = True
            if differ := per_rank.divergent(self._shared_objects()):
                self._refuse(per_rank.refusal(differ))
        trees, tensors, aliases = train_state.collect(self._shared_objects())
        rng_tree, rng_tensors = rng.capture()
        own_trees, own_tensors = per_rank.capture({n: self.objects[n] for n in self.per_rank_names})
        counters = {"step": self.step, "epoch": self.epoch, "rollbacks": self.rollbacks}
        shared_tree = {"objects": trees, "counters": counters, "config": self.config, "aliases": aliases}
        return snapshot.State(shared_tree, tensors, {"rng": rng_tree, per_rank.PREFIX: own_trees},
                              {**rng_tensors, **own_tensors})

    def _info(self) -> snapshot.SnapshotInfo:
        loader = self.objects.get("loader")
        return snapshot.SnapshotInfo(
            run_id=self.env.run_id, lineage=self.lineage, parent=self.parent, step=self.step,
            epoch=getattr(loader, "epoch", self.epoch), samples_seen=getattr(loader, "samples_seen", 0),
            precision=self.precision.applied_mode, config=self.config, code_version=self.code_version,
            world_size_history=self.world_history,
        )

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
        if self.saved_step != self.step and self.step > 0:
            self.save()
            self._settle_saves(wait=True)

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
        self._final_save()
        self.saver.close()
        self.memory.close()
        if self.rank == 0:
            records.log_event(self.run_dir, "completed", step=self.step, attempt=self.env.attempt)
        self.metrics_log.close()
        self.heart.beat(self.step, "done")
        if collectives.active():
            dist.barrier()
            if self.owns_group:
                dist.destroy_process_group()
