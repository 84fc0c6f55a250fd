"""State checks of a :class:`~ckptrun.runtime.step.session.Run`, mixed into it: bad state is never kept, never
looped on, and completion means the final snapshot is published.

Each check sits where its facts already are, at a point every rank reaches at
the same step with the same facts (so ranks never disagree):

- the agreed losses (:mod:`finite_watch`): a save whose window saw a
  non-finite loss is refused; a blow-up rolls back under any ``--on-anomaly``;
  a non-finite or spiking loss right after a restore quarantines the snapshot restored
  (``poisoned``) and restarts from the one before it, twice in a row stops
  (unless ``--on-anomaly rollback``: its in-process rollback answers);
- a save due while one is in flight is skipped only when every rank's saver is
  busy, as the step exchange says (``--save-overlap skip``);
- replicas: a save compares every rank's digests of the replicated tensors
  (:mod:`~ckptrun.runtime.checkpoint.replicas`), and ``--replica-check-every-steps N``
  the same every N steps between saves; a mismatch is ``replicas_diverged``;
- ``finish``: a run whose last loss is non-finite ends with exit 4, one whose
  final snapshot did not publish with exit 1 (``resume --latest`` continues).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptrun.runtime import collectives, records
from ckptrun.runtime.checkpoint import train_state
from ckptrun.runtime.checkpoint.replicas import compare, digests
from ckptrun.runtime.checkpoint.snapshot_types import SaveResult
from ckptrun.runtime.storage import store
from ckptrun.runtime.step import per_rank
from ckptrun.runtime.step.finite_watch import FiniteWatch, limit_for

EXIT_FAILED, EXIT_UNRECOVERABLE = 1, 4


class Safeguards:
    """The checks above; ``Run`` calls them from small hooks."""

    rank: int
    step: int
    env: Any
    run_dir: Path
    ckpt_dir: Path
    restored_from: Path | None
    saver: Any
    parent: str | None
    world_size: int
    objects: dict[str, Any]
    published: str | None
    unsynchronised: bool

    if TYPE_CHECKING:  # provided by Run
        def _shared_objects(self) -> dict[str, Any]: ...
        def _refuse(self, message: str, code: int = ..., fatal: bool = ...) -> None: ...
        def _exit_quietly(self, code: int) -> None: ...
        def _settle_saves(self, wait: bool = False) -> None: ...

    def _start_safeguards(self) -> None:
        """Called once by ``Run.__init__``."""
        self.finite = FiniteWatch(limit_for(self.env.anomaly_window))
        self.published_step: int | None = None  # the step of the last snapshot this process published
        self._all_saving = False  # the last shared facts: every rank's saver was busy then
        self._finishing = False  # the final save (finish, stop): never skipped for overlap
        self.last_good: str | None = None  # retention keeps it: the last snapshot before the first non-finite loss
        if self.rank == 0:  # ... across attempts, from the record
            found = [e for e in records.read_events(self.run_dir, "nonfinite_loss") if e.get("last_good")]
            self.last_good = str(found[0]["last_good"]) if found else None
            self.finite.first_nonfinite = int(found[0]["step"]) if found else None

    # --- losses -------------------------------------------------------------------

    def _watch_loss(self, step: int, loss: float, spiked: bool = False) -> bool:
        """An agreed loss (``spiked``: the anomaly detector flagged it); True when it poisons the snapshot just
        restored (then call :meth:`_blame_restored`).
        Under ``--on-anomaly rollback`` the in-process rollback (data window skipped, LR lowered) answers it
        instead, bounded by ``--max-rollbacks``."""
        if self.finite.observe(step, loss):  # the run's first: every rank is here, so it may wait for the save in
            self._settle_saves(wait=True)  # flight; then the next save's parent is the newest published one, and
            if self.rank == 0:  # every save begun so far began before this step (a save first reads every loss)
                self.last_good = self.parent
                records.log_event(self.run_dir, "nonfinite_loss", step=step, loss=str(loss), attempt=self.env.attempt,
                                  last_good=self.last_good)
        return self.finite.poisoned(spiked) and self.env.on_anomaly != "rollback"

    def _blowup_policy(self, policy: str) -> str:
        """``warn`` for spikes; a loss non-finite K steps in a row rolls back all the same."""
        return "rollback" if policy == "warn" and self.finite.blown_up() else policy

    def _noted_restore(self, path: Path, step: int) -> None:
        """A snapshot was restored: the next K agreed losses judge it."""
        self.finite.restored_step = step
        self.published_step = step

    def _blame_restored(self, step: int, loss: float, why: str | None = None) -> None:
        """Quarantine the snapshot restored (``poisoned``) and leave: exit 1, so that the restart takes the one
        before it; a second poisoned restore in a row is exit 4, naming both."""
        path, restored = self.restored_from, self.finite.restored_step
        if path is None or restored is None:
            return
        reason = f"{why or f'loss {loss}'} at step {step}, {step - restored} step(s) after restoring it"
        previous = self._poisoned_last_attempt() if self.rank == 0 else None
        if self.rank == 0:
            moved = store.quarantine(path, "poisoned", reason, step=step, loss=str(loss))
            records.log_event(self.run_dir, "snapshot_quarantined", attempt=self.env.attempt, snapshot=str(path),
                              step=restored,
                              status="poisoned", cause="poisoned", reason=reason, moved_to=str(moved))
            print(f"ckptrun: snapshot {path.name} is poisoned ({reason}): quarantined, moved to {moved}",
                  file=sys.stderr, flush=True)
            if previous is not None:
                message = (f"two poisoned restores in a row: {previous} and {path.name} (last: {reason}); "
                           "inspect them under quarantine/ and the data of those steps")
                records.write_fatal(self.run_dir, self.rank, message, EXIT_UNRECOVERABLE)
                print(f"error: {message}", file=sys.stderr, flush=True)
        code = collectives.broadcast_object(EXIT_FAILED if previous is None else EXIT_UNRECOVERABLE) \
            if collectives.active() else (EXIT_FAILED if previous is None else EXIT_UNRECOVERABLE)
        self._exit_quietly(code)

    def _poisoned_last_attempt(self) -> str | None:
        """The snapshot the previous attempt quarantined as poisoned, if it did (then this is the second in a row)."""
        found = [e for e in records.read_events(self.run_dir, "snapshot_quarantined")
                 if e.get("cause") == "poisoned" and e.get("attempt") == self.env.attempt - 1]
        return Path(str(found[-1].get("snapshot"))).name if found else None

    # --- saves --------------------------------------------------------------------

    def _agreed_skip(self) -> bool:
        """``--save-overlap skip``: skip this save only when the last shared facts say every rank was saving
        (consumed here: a later save needs facts of its own)."""
        skip = self._all_saving and self.env.save_overlap == "skip" and not self._finishing
        self._all_saving = False
        if skip:  # every rank says so: a test checks that they agree
            records.log_event(self.run_dir, "save_skipped", step=self.step, cause="overlap", rank=self.rank,
                              error="skipped: the previous save is still in flight on every rank")
        return skip

    def _refused_for_loss(self) -> bool:
        """A save whose window saw a non-finite loss is not published (``save_refused``, cause ``non-finite``)."""
        first = self.finite.begin_save()
        if first is None:
            return False
        if self.rank == 0:
            records.log_event(self.run_dir, "save_refused", step=self.step, cause="non-finite",
                              reason=f"a non-finite loss at step {first} since the last save")
            print(f"ckptrun: snapshot of step {self.step} refused: a non-finite loss at step {first}",
                  file=sys.stderr, flush=True)
        return True

    # --- replicas -----------------------------------------------------------------

    def _check_replicas_between_saves(self) -> None:
        """``--replica-check-every-steps N``: every rank at the close of every N-th step without a save (which
        compares them itself) digests its replicas and the ranks compare them as a save does; a mismatch is
        handled as at a save (``replicas_diverged``, ``--on-replica-divergence``)."""
        every = self.env.replica_check_every_steps
        if every is None or self.world_size < 2 or self.step % every:
            return
        _, tensors, _ = train_state.collect(self._shared_objects())
        skip = train_state.first_rank_keys(self.objects)  # DDP buffers are rank 0's by design
        diverged = compare(collectives.all_gather_object(digests({k: t for k, t in tensors.items() if k not in skip})))
        if diverged is None:
            return
        result = SaveResult(False, self.step, error=diverged.describe(), refused="replicas-diverged",
                            diverged=(diverged.tensor, diverged.ranks))
        self._settle_saves(wait=True)  # a save in flight compared at its own step: its outcome first
        if self.rank == 0:
            self._record_divergence(result, at="check")
        collectives.barrier()  # recorded before any rank leaves
        self._act_on_divergence(result)

    def _no_restart_helps(self, result: Any) -> str | None:
        """Why a restart cannot mend this divergence (then it is exit 4 whatever the policy but ``warn``), or None.
        The same facts on every rank: nothing wraps the model, or no snapshot of this process agreed yet."""
        if self.unsynchronised:
            return per_rank.unsynchronised_refusal(result.error, result.step)
        if self.published is None and self.restored_from is None:
            return (f"{result.error} at step {result.step}, before any snapshot whose replicas agreed: there is "
                    "nothing to go back to; check the model's initialisation (every rank the same seed, or DDP)")
        return None

    def _record_divergence(self, result: Any, at: str = "save") -> None:
        """Rank 0, on the writer thread as soon as the ranks compared (before any rank acts on it): the event,
        naming a rank that diverged before as the suspect device, and for ``stop`` the fatal record."""
        tensor, ranks = result.diverged
        fatal = self._no_restart_helps(result)
        before = [r for e in records.read_events(self.run_dir, "replicas_diverged") for r in e.get("ranks", [])]
        suspects = [r for r in ranks if r in before] if fatal is None else []
        policy = self.env.on_replica_divergence
        records.log_event(self.run_dir, "replicas_diverged", step=result.step, ranks=list(ranks), tensor=tensor,
                          attempt=self.env.attempt, policy=policy, suspect=suspects, at=at,
                          cause="unsynchronised" if self.unsynchronised else "no-agreed-snapshot" if fatal else None)
        words = f"; rank(s) {', '.join(map(str, suspects))} diverged before: suspect device" if suspects else ""
        where = "snapshot not published" if at == "save" else "found by --replica-check-every-steps"
        print(f"ckptrun: {result.error} at step {result.step}: {where} (policy: {policy}){words}",
              file=sys.stderr, flush=True)
        if policy == "stop" or policy == "restart" and fatal is not None:
            records.write_fatal(self.run_dir, 0, fatal or f"{result.error} at step {result.step}{words}",
                                EXIT_UNRECOVERABLE)

    def _act_on_divergence(self, result: Any) -> None:
        """Every rank, when it collects the result: restart (exit 1: the supervisor restores the newest snapshot,
        whose replicas agreed) or stop (exit 4); ``warn`` trains on. No barrier: ranks collect at their own time."""
        policy = self.env.on_replica_divergence
        if policy == "warn":
            return
        fatal = self._no_restart_helps(result) if policy == "restart" else None
        if fatal is not None:
            print(f"error: {fatal}", file=sys.stderr, flush=True)
        else:
            print(f"error: {result.error} at step {result.step}; "
                  f"{'restarting from the last snapshot whose replicas agreed' if policy == 'restart' else 'stopped'}",
                  file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_FAILED if policy == "restart" and fatal is None else EXIT_UNRECOVERABLE)

    # --- the end ------------------------------------------------------------------

    def _require_finite_end(self) -> None:
        """Never "completed" on a non-finite loss: exit 4 naming the step."""
        step = self.finite.final_nonfinite()
        if step is not None:
            self._refuse(f"the loss is non-finite at step {step}, the last step: the run did not complete "
                         f"(roll back with --on-anomaly rollback, or resume from an older snapshot)", EXIT_UNRECOVERABLE)

    def _require_final_snapshot(self) -> None:
        """Completion means the final snapshot is published; else exit 1 naming the newest one."""
        if self.step == 0 or self.published_step == self.step:
            return
        newest = self.published_step
        where = f"the newest snapshot is step {newest}" if newest is not None else "no snapshot of this attempt published"
        self._refuse(f"the final save at step {self.step} failed: {where}; fix the checkpoint location, then "
                     "`ckptrun resume --latest` continues", EXIT_FAILED)
