"""ckptrun for PyTorch Lightning: two lines in a Lightning script.

    trainer = Trainer(callbacks=[checkpoint, CkptrunCallback()])
    trainer.fit(model, data, ckpt_path=resume_path(checkpoint.dirpath))

:class:`CkptrunCallback` beats this rank's heartbeat with the trainer's ``global_step`` (across attempts),
logs loss, lr and step to ``metrics.jsonl``, and acts on ``ckptrun stop`` at a batch boundary all ranks
agree on: it saves a checkpoint through the trainer into the ``ModelCheckpoint`` directory and leaves with
exit 3. It also wraps the strategy's ``CheckpointIO``, so that every checkpoint Lightning writes is written
to a temp name, fsynced, renamed into place and published with a ckptrun manifest
(:mod:`ckptrun.runtime.checkpoint.framework_files`): ``ckptrun verify DIR`` checks it and
:func:`resume_path` returns the newest that verifies (None on a fresh run, so one command line serves the
first attempt and every restart). Not bitwise exact: Lightning stores no RNG state.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import CheckpointIO

from ckptrun.runtime.checkpoint import framework_files
from ckptrun.integrations.framework_run import FrameworkRun

FRAMEWORK = "lightning"


class PublishingCheckpointIO(CheckpointIO):
    """Wraps the strategy's own ``CheckpointIO``: it writes a temp file, ckptrun places and publishes it."""

    def __init__(self, inner: CheckpointIO, run_id: str) -> None:
        self.inner, self.run_id = inner, run_id

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        final = Path(path)
        final.parent.mkdir(parents=True, exist_ok=True)
        temp = final.with_name(f".ckptrun-{uuid.uuid4().hex[:8]}-{final.name}")
        self.inner.save_checkpoint(checkpoint, temp, storage_options=storage_options)
        framework_files.place_file(temp, final)
        framework_files.publish(final, FRAMEWORK, self.run_id, int(checkpoint.get("global_step", 0)))

    def load_checkpoint(self, path: Any, map_location: Any = None, **kwargs: Any) -> dict[str, Any]:
        return self.inner.load_checkpoint(path, map_location=map_location, **kwargs)

    def remove_checkpoint(self, path: Any) -> None:
        framework_files.remove(Path(path))

    def teardown(self) -> None:
        self.inner.teardown()


class CkptrunCallback(Callback):
    """Heartbeats and metrics with the global step, a graceful agreed stop, and published checkpoints."""

    def __init__(self) -> None:
        self.run = FrameworkRun(FRAMEWORK)
        self.logged = -1

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy.checkpoint_io, PublishingCheckpointIO):
            strategy.checkpoint_io = PublishingCheckpointIO(strategy.checkpoint_io, self.run.run_id)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.run.start(trainer.global_step)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        self.run.step_done(step)
        if step > self.logged:
            self.logged = step
            self.run.log_step(step, loss=_loss(outputs), lr=_lr(trainer))
        if self.run.active and trainer.strategy.reduce_boolean_decision(self.run.stop_requested_here(), all=False):
            path = checkpoint_dir(trainer) / f"stop-step={step}.ckpt"
            trainer.save_checkpoint(path)  # collective: rank 0 writes and publishes, every rank waits
            self.run.exit_stopped(step, path)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.run.beat(trainer.global_step, "done", force=True)


def checkpoint_dir(trainer: Trainer) -> Path:
    """Where the stop checkpoint goes: the ``ModelCheckpoint``'s directory, so :func:`resume_path` finds it."""
    callback = trainer.checkpoint_callback
    if isinstance(callback, ModelCheckpoint) and callback.dirpath:
        return Path(callback.dirpath)
    return Path(trainer.default_root_dir) / "checkpoints"


def resume_path(dirpath: str | Path | None) -> str | None:
    """The newest checkpoint under ``dirpath`` that matches its ckptrun manifest, for ``fit(ckpt_path=...)``;
    None when there is none (a fresh run). Newer ones that fail are named on stderr and skipped."""
    if dirpath is None:
        return None
    found = framework_files.newest_verified(Path(dirpath))
    return str(found[0]) if found else None


def _loss(outputs: Any) -> float | None:
    value = outputs.get("loss") if isinstance(outputs, dict) else outputs
    return float(value.detach().item()) if hasattr(value, "detach") else None


def _lr(trainer: Trainer) -> float | None:
    optimizers = trainer.optimizers
    return float(optimizers[0].param_groups[0]["lr"]) if optimizers else None
