"""What ``--on-anomaly`` does with a suspect loss, mixed into :class:`~ckptrun.runtime.step.session.Run`.

``warn`` logs it; ``stop`` refuses to go on (a fatal record: a restart would
train on the same state); ``rollback`` restores the previous verified snapshot
in this process, forks the lineage, lowers the learning rate and keeps the
data position, so the window that caused the anomaly is skipped.

Rollbacks are counted per run, from the run record (never from a snapshot,
whose counters are those of the past it restores): the k-th rollback of a run
sets the learning rate to ``factor**k`` of the unlowered one, the one after
``--max-rollbacks`` stops (exit 4), and a blow-up that comes back at the very
step a rollback left, with the data window skipped and the rate lowered, is the
data's or the hyperparameters' doing, not the state's: it stops at once.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptrun.runtime import collectives, records
from ckptrun.runtime.checkpoint import snapshot
from ckptrun.runtime.env import RunEnv
from ckptrun.runtime.step import hparams
from ckptrun.runtime.storage import store


class Rollback:
    """``_on_anomaly`` (called by :mod:`step_end` when a step's shared loss is suspect) and the rollback."""

    env: RunEnv
    rank: int
    run_dir: Path
    ckpt_dir: Path
    step: int
    rollbacks: int
    lr_scale: float
    objects: dict[str, Any]
    lineage: str
    parent: str | None
    saved_step: int | None
    anomalies: Any  # step.anomaly.AnomalyDetector

    if TYPE_CHECKING:  # provided by the other parts of Run; stubs here would shadow them in the MRO
        def _refuse(self, message: str, code: int = ..., fatal: bool = ...) -> None: ...
        def _settle_saves(self, wait: bool = False) -> None: ...
        def _load_newest(self) -> tuple[Path, snapshot.Loaded] | None: ...
        def _apply(self, loaded: snapshot.Loaded) -> None: ...

    def _on_anomaly(self, reason: str, step: int) -> bool:
        """Apply --on-anomaly to step ``step``'s loss; True when the run was rolled back (its counters are the snapshot's)."""
        policy = self._blowup_policy(self.env.on_anomaly)
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

    def _rollback_history(self) -> tuple[int, int | None]:
        """(this run's rollbacks so far, the step the last one left): rank 0 reads the record, every rank gets it."""
        found = records.read_events(self.run_dir, "rollback") if self.rank == 0 else []
        facts = (len(found), int(found[-1]["from_step"]) if found else None)
        return collectives.broadcast_object(facts)

    def _refuse_another_rollback(self, reason: str, from_step: int) -> None:
        """Exit 4 when this anomaly must not be rolled back again: the budget is spent, or it recurred."""
        self.rollbacks, last_from = self._rollback_history()
        if last_from == from_step:
            self._refuse(f"anomaly at step {from_step} came back at the same step after rollback {self.rollbacks} "
                         f"({reason}), with the data window skipped and the learning rate at "
                         f"{self.env.rollback_lr_factor ** self.rollbacks:g}x: the data or the hyperparameters of "
                         "those steps, not the snapshot; inspect them, then `ckptrun resume --latest`")
        if self.rollbacks >= self.env.max_rollbacks:
            self._refuse(f"anomaly at step {from_step} after {self.rollbacks} rollback(s) in this run, "
                         f"--max-rollbacks {self.env.max_rollbacks} ({reason}); lower the learning rate or inspect "
                         "the data")

    def _rollback(self, reason: str, from_step: int) -> None:
        """Restore the previous verified snapshot in-process, fork the lineage, lower the LR, skip the data window."""
        self._refuse_another_rollback(reason, from_step)
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
        self.finite.rolled_back()
        self.published_step = self.step
        factor = self.env.rollback_lr_factor
        lowered = factor ** self.rollbacks  # of the unlowered rate; the snapshot's own state carries lr_scale
        hparams.scale_lr(self.objects.get("optimizer"), self.objects.get("scheduler"), lowered / self.lr_scale)
        self.lr_scale = lowered
        self.anomalies.history.clear()
        if self.rank == 0:
            records.log_event(self.run_dir, "rollback", from_step=from_step, to_step=self.step, snapshot=str(path),
                              lr_factor=factor, lr_scale=lowered, rollbacks=self.rollbacks, reason=reason)
