"""What every framework integration does for ckptrun, whatever the framework: one object per process.

It reads the run's contract (C1) once, beats this rank's heartbeat with the framework's *global* step and fires the step faults at it
(``source="framework"``: the bootstrap's per-attempt optimizer-step count falls silent), logs rank 0's
metrics, tells whether a stop was requested (the supervisor's stop file, agreed by all ranks through one
all-reduce) and, once the framework has saved, logs the ``stopped`` event and leaves with exit 3 after the
ranks agree. Outside ``ckptrun launch`` (plain ``python`` or ``torchrun``) every method does nothing.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from ckptrun.runtime import records
from ckptrun.runtime.env import EnvError, RunEnv
from ckptrun.runtime.faults import parse_faults
from ckptrun.runtime.records import Phase
from ckptrun.runtime.worker.fault_injection import FaultInjector
from ckptrun.runtime.worker.liveness import Heartbeater

EXIT_STOPPED = 3  # design §4: stopped and resumable


class FrameworkRun:
    """This rank's link to the supervisor, for a script whose loop a framework runs."""

    def __init__(self, framework: str) -> None:
        self.framework = framework
        try:
            self.env: RunEnv | None = RunEnv.from_env()
        except EnvError as exc:
            print(f"ckptrun: the {framework} integration is off: {exc}", file=sys.stderr, flush=True)
            self.env = None
        if self.env is not None and not self.env.supervised:
            self.env = None
        self.rank = int(os.environ.get("RANK", "0"))
        self.heart = (Heartbeater(self.env.run_dir, self.rank, self.env.attempt, self.env.heartbeat_interval,
                                  source="framework") if self.env is not None else None)
        self._stop_path = str(self.env.run_dir / "stop") if self.env is not None else None
        self.faults = (FaultInjector(parse_faults(self.env.fault), self.rank, self.env.attempt, self.env.run_dir)
                       if self.env is not None else None)
        self.started = False

    @property
    def active(self) -> bool:
        return self.env is not None

    @property
    def run_id(self) -> str:
        return self.env.run_id if self.env is not None else "local"

    def start(self, step: int) -> None:
        """Training starts (or resumes) at global ``step``: one event, so that restarts show where they resumed."""
        if self.env is None or self.started:
            return
        self.started = True
        self.beat(step, "train", force=True)
        if self.rank == 0:
            records.log_event(self.env.run_dir, "framework_started", attempt=self.env.attempt, step=step,
                              framework=self.framework)

    def beat(self, step: int, phase: Phase = "train", force: bool = False) -> None:
        if self.heart is not None:
            self.heart.beat(step, phase, force=force)

    def step_done(self, step: int) -> None:
        """Global ``step`` is done: beat, then fire the step faults of C1 (``kill``/``hang``/``exit`` at it)."""
        if self.faults is None:
            return
        if self.heart is not None:  # an injected hang keeps the last beat's time: the hung rank must not look alive
            self.heart.beat(step, "train", force=self.faults.step_fault_due(step), stale=self.faults.hang_due(step))
        self.faults.after_step(step)

    def log_step(self, step: int, **values: Any) -> None:
        """Rank 0's metrics line for one global step (values that are None are left out)."""
        if self.env is None or self.rank != 0:
            return
        record = {"step": step, "attempt": self.env.attempt, "time": time.time(), "source": self.framework}
        record.update({k: v for k, v in values.items() if v is not None})
        records.log_metrics(self.env.run_dir, record)

    def stop_requested_here(self) -> bool:
        """This rank sees a stop request (not yet agreed)."""
        return self._stop_path is not None and os.access(self._stop_path, os.F_OK)

    def event(self, name: str, **fields: Any) -> None:
        if self.env is not None and self.rank == 0:
            records.log_event(self.env.run_dir, name, attempt=self.env.attempt, framework=self.framework, **fields)

    def exit_stopped(self, step: int, checkpoint: Path | None) -> NoReturn:
        """The framework saved at the agreed boundary: say so, wait for every rank, leave with exit 3."""
        self.event("stopped", step=step, checkpoint=str(checkpoint) if checkpoint else None)
        self.beat(step, "done", force=True)
        barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_STOPPED)


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def agree_any(flag: bool) -> bool:
    """True on every rank when any rank's ``flag`` is True (one all-reduce; the local flag without a group)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return flag
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())
