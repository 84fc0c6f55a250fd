"""Saving, mixed into :class:`~ckptrun.runtime.step.session.Run`: a snapshot at a step boundary and its outcome.

``save`` collects the whole state (tracked objects, counters, config, every
rank's RNG) and hands it to the :class:`~ckptrun.runtime.checkpoint.saver.Saver`;
at most one save is in flight, and its outcome, settled later on the training
thread, names the next snapshot's parent and spends the consecutive-failure
budget. Rank 0 logs each result, applies retention, and under
``--save-every auto`` retunes the interval from the measured cost.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptrun.runtime import records
from ckptrun.runtime.checkpoint import hf_weights, snapshot, train_state
from ckptrun.runtime.checkpoint.policies import AutoCadence, FailedSaves, Retention, SaveCadence
from ckptrun.runtime.checkpoint.retention import apply_retention
from ckptrun.runtime.env import RunEnv
from ckptrun.runtime.step import per_rank, rng
from ckptrun.runtime.step.exit_codes import EXIT_FAILED
from ckptrun.runtime.step.loop import untracked_loader_in_use
from ckptrun.runtime.step.precision import Policy
from ckptrun.runtime.storage import store


class Saving:
    """``save``, the memory-tier save, and the accounting of finished saves."""

    env: RunEnv
    rank: int
    run_dir: Path
    ckpt_dir: Path
    step: int
    epoch: int
    rollbacks: int
    lr_scale: float
    config: dict[str, Any]
    objects: dict[str, Any]
    precision: Policy
    code_version: str
    lineage: str
    world_history: list[Any]
    parent: str | None
    published: str | None
    saved_step: int | None
    save_budget_spent: str | None
    last_save_time: float
    auto: AutoCadence | None
    cadence: SaveCadence
    retention: Retention
    failed_saves: FailedSaves
    _loaders_checked: bool
    saver: Any  # checkpoint.saver.Saver
    anomalies: Any  # step.anomaly.AnomalyDetector
    memory: Any  # checkpoint.memory_tier.MemoryTier
    heart: Any  # worker.liveness.Heartbeater
    faults: Any  # worker.fault_injection.FaultInjector

    if TYPE_CHECKING:  # provided by the other parts of Run; stubs here would shadow them in the MRO
        def _refuse(self, message: str, code: int = ..., fatal: bool = ...) -> None: ...
        def _settle_decisions(self) -> bool: ...

    def save(self) -> None:
        """Snapshot the whole state at this step boundary; async saves return once the state is staged."""
        if self._settle_decisions():  # the step's line and anomaly check come first (every rank is here)
            return  # rolled back: the state is a verified snapshot's
        if self._agreed_skip() or self._refused_for_loss():  # every rank alike: the facts were shared
            return
        self.heart.beat(self.step, "save")
        self._check_loaders()
        step, started = self.step, time.monotonic()
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
        step = self.step
        self.memory.save(self._collect(), self._info(), fault=lambda phase: self.faults.during_memory_save(step, phase))
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
            apply_retention(self.ckpt_dir, self.retention, self.run_dir, self.env.paranoid_retention, self.saver.remote,
                            keep=self.last_good)
        else:
            if result.diverged is not None:
                self._record_divergence(result)
            kind = "save_refused" if result.refused else "save_skipped" if result.skipped else "save_failed"
            records.log_event(self.run_dir, kind, step=result.step, error=result.error, cause=result.refused)
            print(f"ckptrun: SAVE {'REFUSED' if result.refused else 'FAILED'} at step {result.step}: {result.error}",
                  file=sys.stderr, flush=True)

    def _settle_saves(self, wait: bool = False) -> None:
        """Account for finished saves: the parent of the next one, and the consecutive-failure budget."""
        self.memory.settle(wait)
        for result in self.saver.collect(wait):
            if result.ok:
                self.published, self.published_step = result.path.name, result.step  # type: ignore[union-attr]
            elif self.saved_step == result.step:  # saved_step stays: it moved on every rank at the same step
                self.parent = self.published
            if result.diverged is not None:
                self._act_on_divergence(result)
            if self.failed_saves.record(result.ok):
                self.save_budget_spent = f"{self.failed_saves.consecutive} consecutive saves failed (last: {result.error})"
            if self.rank == 0:
                self._retune(result)

    def _retune(self, result: snapshot.SaveResult) -> None:
        """``--save-every auto`` on rank 0 (whose clock decides, shared with the steps' facts): the time
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

    def _model_config(self) -> dict[str, Any] | None:
        """A Hugging Face model's config as JSON, serialised once per attempt (not in every save's stall)."""
        if not hasattr(self, "_hf_config"):
            self._hf_config = hf_weights.model_config(self.objects.get("model"))
        return self._hf_config

    def _collect(self) -> snapshot.State:
        if not self.checked_replicas:
            self.checked_replicas = True
            if differ := per_rank.divergent(self._shared_objects()):
                self._refuse(per_rank.refusal(differ))
        trees, tensors, aliases = train_state.collect(self._shared_objects())
        rng_tree, rng_tensors = rng.capture()
        own_trees, own_tensors = per_rank.capture({n: self.objects[n] for n in self.per_rank_names})
        counters = {"step": self.step, "epoch": self.epoch, "rollbacks": self.rollbacks, "lr_scale": self.lr_scale}
        shared_tree = {"objects": trees, "counters": counters, "config": self.config, "aliases": aliases,
                       "losses": list(self.anomalies.history),  # the spike detector's window: see restoring._apply
                       "model_config": self._model_config()}  # config.json of an export
        return snapshot.State(shared_tree, tensors, {"rng": rng_tree, per_rank.PREFIX: own_trees},
                              {**rng_tensors, **own_tensors}, first_rank_keys=train_state.first_rank_keys(self.objects))

    def _info(self) -> snapshot.SnapshotInfo:
        loader = self.objects.get("loader")
        return snapshot.SnapshotInfo(
            run_id=self.env.run_id, lineage=self.lineage, parent=self.parent, step=self.step,
            epoch=getattr(loader, "epoch", self.epoch), samples_seen=getattr(loader, "samples_seen", 0),
            precision=self.precision.applied_mode, config=self.config, code_version=self.code_version,
            world_size_history=self.world_history,
        )
