"""Resuming a run, mixed into :class:`~ckptrun.runtime.step.session.Run`: which snapshot, is it compatible, load it.

Supervised, the snapshot is the one C1 names (the supervisor verified it) and
one that does not load fails the attempt; unsupervised, rank 0 verifies and
picks the newest of the lineage and every rank loads its choice, falling back
to older ones when one verifies but does not load. A snapshot written at
another world size brings no per-rank state (:mod:`reshard`); a config that
changed since it was written is refused unless ``--allow-change`` names it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptrun.runtime import collectives, records
from ckptrun.runtime.checkpoint import hf_weights, snapshot, tiering, train_state
from ckptrun.runtime.checkpoint.policies import refused_changes
from ckptrun.runtime.checkpoint.verify import newest_verified
from ckptrun.runtime.env import RunEnv
from ckptrun.runtime.step import hparams, per_rank, reshard, rng
from ckptrun.runtime.step.exit_codes import EXIT_FAILED
from ckptrun.runtime.storage import store
from ckptrun.runtime.worker import timeline


def _process_start_time() -> float:
    import psutil

    return psutil.Process().create_time()


class Restoring:
    """``restore`` and what it is made of: choose, check, load and apply a snapshot."""

    env: RunEnv
    rank: int
    world_size: int
    run_dir: Path
    ckpt_dir: Path
    step: int
    epoch: int
    lr_scale: float
    config: dict[str, Any]
    changed: dict[str, tuple[Any, Any]]
    objects: dict[str, Any]
    code_version: str
    lineage: str
    world_history: list[Any]
    parent: str | None
    saved_step: int | None
    restored_from: Path | None
    _chosen_source: str | None = None  # tiering.LOCAL / REMOTE for a store run's choice, None for a local dir
    _refetched: set[str] = set()  # replaced per restore: never mutated here
    saver: Any  # checkpoint.saver.Saver
    anomalies: Any  # step.anomaly.AnomalyDetector
    memory: Any  # checkpoint.memory_tier.MemoryTier
    heart: Any  # worker.liveness.Heartbeater
    faults: Any  # worker.fault_injection.FaultInjector

    if TYPE_CHECKING:  # provided by Run; stubs here would shadow them in the MRO
        def _refuse(self, message: str, code: int = ..., fatal: bool = ...) -> None: ...
        def _exit_quietly(self, code: int) -> None: ...

    def restore(self) -> int:
        """Load the snapshot this attempt resumes from, if any; returns the step to continue from.

        Supervised: exactly the snapshot named in C1 (the supervisor verified it);
        if it does not load, this attempt fails. Otherwise rank 0 verifies and
        picks the newest snapshot of the lineage, falling back to older ones that
        verify when one does not load, and says why.
        """
        self.heart.beat(self.step, "restore")
        skipped: set[str] = set()
        self._refetched: set[str] = set()  # local copies that failed at load and were fetched again (once each)
        while True:
            chosen = self._choose_snapshot(skipped)
            if chosen is None:
                if self.env.exit_after_restore:
                    self._refuse(f"probe: no verified snapshot in {self.ckpt_dir} to restore", 2, fatal=False)
                if skipped:
                    self._refuse(f"no snapshot in {self.ckpt_dir} loads (tried {', '.join(sorted(skipped))}); "
                                 f"inspect them with `ckptrun verify {self.ckpt_dir}`")
                if self.env.init_weights is not None:
                    self._start_from_weights(self.env.init_weights)
                if self.rank == 0:  # a start from nothing: its start-up, which the recovery estimate models a restart on
                    records.log_event(self.run_dir, "started", attempt=self.env.attempt,
                                      startup={"process": _process_start_time(), **timeline.MARKS})
                return self.step
            started = time.monotonic()
            fetched = self.memory.fetch(chosen)  # a lost node's shards, from another node's replica (many nodes)
            if fetched is not None:
                self._restore_failed(chosen, fetched)
            self._check_compatible(snapshot.read_manifest(chosen))
            try:
                loaded = self._load(chosen)
            except snapshot.LoadError as exc:
                self._restore_failed(chosen, str(exc))
                if not self._refetch(chosen, str(exc)):
                    skipped.add(chosen.name)
                continue
            self._apply(loaded)
            self.restored_from, self.parent, self.saved_step = chosen, chosen.name, self.step
            self._noted_restore(chosen, self.step)
            if self.memory.holds(chosen):  # not durable: the next save's parent is its durable one, and a stop saves
                self.parent, self.saved_step, self.published_step = loaded.manifest.parent, None, None
            self.faults.after_restore(self.step, self.objects.get("model"))
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

    def _start_from_weights(self, path: Path) -> None:
        """``--init-weights``, on a start with no snapshot to restore: every rank hashes the files again (they
        must be the ones the launch hashed) and loads them into the tracked model (exit 2 when they do not fit)."""
        started = time.monotonic()
        model = self.objects.get("model")
        if model is None:
            self._refuse("--init-weights needs the script to track its model: run.track(model=...)", 2)
        try:
            digest = hf_weights.digest(path)
            if self.env.init_weights_sha256 is not None and digest != self.env.init_weights_sha256:
                raise hf_weights.WeightsError(f"--init-weights {path} changed since the launch hashed it "
                                              f"(sha256 {digest[:12]}…, launch {self.env.init_weights_sha256[:12]}…)")
            tensors = hf_weights.load_into(model, path)
        except (hf_weights.WeightsError, OSError) as exc:
            self._refuse(str(exc), 2)
        if self.rank == 0:
            records.log_event(self.run_dir, "init_weights", attempt=self.env.attempt, path=str(path), sha256=digest,
                              tensors=tensors, seconds=time.monotonic() - started)
            print(f"ckptrun: started from {path} ({tensors} tensors, sha256 {digest[:12]}…)", file=sys.stderr, flush=True)

    def _restore_failed(self, path: Path, reason: str) -> None:
        self._note_unloadable(path, reason)
        if self.env.resume_from is not None:
            self._refuse(f"snapshot {path} named for this attempt does not load: {reason}", EXIT_FAILED, fatal=False)

    def _refetch(self, path: Path, reason: str) -> bool:
        """A tiered run's local copy that failed its digest at load is set aside (rank 0 moves it to quarantine)
        and the same snapshot is downloaded again from the store, whose objects are hashed as they stream:
        once per snapshot, so damage the store shares falls back to the older one. Every rank decides alike
        (the load failure is agreed; the source is broadcast with the choice)."""
        if not tiering.damaged_copy(self._chosen_source, reason) or path.name in self._refetched:
            return False
        self._refetched.add(path.name)
        if self.rank == 0 and path.is_dir():
            moved = store.quarantine(path, "corrupt", reason)
            records.log_event(self.run_dir, "snapshot_quarantined", attempt=self.env.attempt, snapshot=str(path),
                              status="corrupt", cause="digest", tier=tiering.LOCAL, reason=reason, moved_to=str(moved))
            print(f"ckptrun: the local copy of {path.name} failed its digest at load: set aside in {moved}, "
                  f"fetching it again from {self.saver.remote.where}", file=sys.stderr, flush=True)
        return True

    def _choose_snapshot(self, skipped: set[str]) -> Path | None:
        if self.env.resume_from is not None:
            return self.env.resume_from
        if self.env.supervised:
            return None
        return self._newest_verified(skipped)

    def _newest_verified(self, skipped: set[str]) -> Path | None:
        """Rank 0 verifies and picks, every rank gets its choice (ranks must agree on what they load)."""
        choice, source = None, None
        if self.rank == 0 and self.saver.remote is not None:  # an object store: its manifests decide (runtime.tiering)
            found = tiering.choose_for_worker(self.saver.remote, self.ckpt_dir, self.run_dir, skipped,
                                              log=lambda line: print(f"ckptrun: {line}", file=sys.stderr))
            choice, source = (str(found.path), found.source) if found else (None, None)
        elif self.rank == 0:
            report = newest_verified(self.ckpt_dir, log=lambda line: print(f"ckptrun: {line}", file=sys.stderr), skip=skipped,
                                     at_load=True)  # chunked snapshots: sizes here, every byte verified as loaded
            choice = str(report.path) if report else None
        choice, self._chosen_source = collectives.broadcast_object((choice, source))
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
        self.lr_scale = float(tree["counters"].get("lr_scale", 1.0))  # the rollbacks' lowering this state carries
        self.anomalies.history.clear()  # the losses before the snapshot: a spike right after it is judged, and
        self.anomalies.history.extend(float(x) for x in tree.get("losses", []))  # blames it (safeguards)
        if not loaded.rank_tree:  # written at another world size: per-rank state does not carry over
            reshard.reseed(self.env.seed, self.step, self.rank)
            reshard.record(self, loaded.manifest)
        elif not self.faults.has("skip-rng-restore"):
            rng.restore(loaded.rank_tree["rng"], loaded.rank_tensors)
        self.world_history = reshard.history(loaded.manifest, self.world_size, self.step)
        self.lineage = store.read_lineage(self.ckpt_dir).current if store.read_lineage(self.ckpt_dir) else loaded.manifest.lineage
