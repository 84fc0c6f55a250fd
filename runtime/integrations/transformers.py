"""ckptrun for the Hugging Face ``Trainer``: two lines in a Trainer script.

    trainer = Trainer(model, args, train_dataset=data, callbacks=[CkptrunCallback()])
    trainer.train(resume_from_checkpoint=resume_path(args.output_dir))

:class:`CkptrunCallback` beats this rank's heartbeat with ``state.global_step`` (across attempts), logs
loss, lr and grad norm to ``metrics.jsonl``, publishes every ``checkpoint-N`` directory once the Trainer has
written it (all ranks' files fsynced, then a ckptrun manifest committed inside it:
:mod:`ckptrun.runtime.checkpoint.framework_files`) and acts on ``ckptrun stop`` at a step all ranks agree
on: ``should_save`` + ``should_training_stop``, then, once that checkpoint is published, exit 3.
:func:`resume_path` returns the newest published checkpoint that verifies (None on a fresh run).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ckptrun.integrations.framework_run import FrameworkRun, agree_any, barrier
from ckptrun.runtime.checkpoint import framework_files

FRAMEWORK = "transformers"


class CkptrunCallback(TrainerCallback):
    """Heartbeats and metrics with the global step, published checkpoints, and a graceful agreed stop."""

    def __init__(self) -> None:
        self.run = FrameworkRun(FRAMEWORK)
        self.stopping = False

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        self.run.start(state.global_step)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        self.run.step_done(state.global_step)
        if not control.should_log:  # on_log follows when it is due, with the loss
            self.run.log_step(state.global_step)
        if self.run.active and agree_any(self.run.stop_requested_here()):
            self.stopping = True
            control.should_save = True
            control.should_training_stop = True

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self.run.log_step(state.global_step, loss=logs.get("loss"), lr=logs.get("learning_rate"),
                              grad_norm=logs.get("grad_norm"))

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        path = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        barrier()  # every rank has written its files (rng_state_R.pth) before rank 0 hashes them
        if state.is_world_process_zero and path.is_dir():
            framework_files.publish(path, FRAMEWORK, self.run.run_id, state.global_step)
        barrier()
        if self.stopping:
            self.run.exit_stopped(state.global_step, path)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if self.stopping:  # no checkpoint was written at the stop (it never reached on_save)
            self.run.exit_stopped(state.global_step, None)
        self.run.beat(state.global_step, "done", force=True)


def resume_path(output_dir: str | Path | None) -> str | None:
    """The newest ``checkpoint-N`` under ``output_dir`` that matches its ckptrun manifest, for
    ``trainer.train(resume_from_checkpoint=...)``; None when there is none (a fresh run)."""
    if output_dir is None:
        return None
    found = framework_files.newest_verified(Path(output_dir))
    return str(found[0]) if found else None
