"""Fires the test faults that C1's ``fault`` field names, at the points the spec says (see runtime.faults)."""

from __future__ import annotations

import errno
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ckptrun.runtime import records
from ckptrun.runtime.faults import Fault


class FaultInjector:
    """Fires the test faults of C1 at the points the spec names (see runtime.faults)."""

    def __init__(self, faults: list[Fault], rank: int, attempt: int, run_dir: Path | None = None) -> None:
        self.faults = [f for f in faults if f.applies(rank, attempt)]
        self.fired: set[int] = set()  # each fault fires once per process
        self.rank, self.attempt, self.run_dir = rank, attempt, run_dir
        self.saving: tuple[int, str] | None = None  # (step, phase) of the save in flight, for kill-at's record

    def arm_timers(self) -> None:
        """Start the kill-at timers; their ``after`` counts from this call (the runtime's init())."""
        for fault in self.faults:
            if fault.kind == "kill-at":
                timer = threading.Timer(fault.after or 0.0, self._fire, (fault,))
                timer.daemon = True
                timer.start()

    def _once(self, fault: Fault) -> bool:
        if id(fault) in self.fired:
            return False
        self.fired.add(id(fault))
        return True

    def has(self, kind: str) -> bool:
        return any(f.kind == kind for f in self.faults)

    def step_fault_due(self, step: int, micro: int | None = None) -> bool:
        """A kill/hang/exit is due here; the caller first lets in-flight saves publish, so that
        which snapshot a test resumes from does not depend on the writer's speed."""
        return any(f.kind in ("kill", "hang", "exit") and f.step == step and f.micro == micro for f in self.faults)

    def hang_due(self, step: int) -> bool:
        return any(f.kind == "hang" and f.step == step and f.micro is None for f in self.faults)

    def after_step(self, step: int) -> None:
        for fault in self.faults:
            if fault.kind in ("kill", "hang", "exit") and fault.step == step and fault.micro is None:
                self._fire(fault)

    def inside_step(self, done_step: int, micro: int) -> None:
        for fault in self.faults:
            if fault.kind in ("kill", "hang", "exit") and fault.step == done_step and fault.micro == micro:
                self._fire(fault)

    def nan_loss(self, step: int) -> bool:
        """True when the step that follows ``step`` must report a NaN loss (anomaly tests)."""
        return any(f.kind == "nan" and f.step == step and self._once(f) for f in self.faults)

    def after_backward(self, step: int, model: Any) -> None:
        """inf-grad: write inf into this rank's first gradient after DDP's all-reduce (fp16 tests)."""
        for fault in self.faults:
            if fault.kind == "inf-grad" and fault.step == step and self._once(fault):
                grad = next(p.grad for p in model.parameters() if p.grad is not None)
                grad.view(-1)[0] = float("inf")

    def after_optimizer_step(self, step: int, model: Any) -> None:
        """nan-after / nudge-replica: once ``step`` is done, damage this rank's parameters (state tests);
        nan-recurring: every time ``step`` is done."""
        for fault in self.faults:
            if fault.kind == "nan-recurring" and fault.step == step:
                _damage(model, nudge=False)
            elif fault.kind in ("nan-after", "nudge-replica") and fault.step == step and self._once(fault):
                _damage(model, nudge=fault.kind == "nudge-replica")

    def after_restore(self, step: int, model: Any) -> None:
        """poison-after-restore: the snapshot of ``step`` was just restored; its values become NaN."""
        for fault in self.faults:
            if fault.kind == "poison-after-restore" and fault.step == step and self._once(fault):
                _damage(model, nudge=False)

    def during_save(self, step: int, phase: str) -> None:
        """A save reached ``phase`` ("done" when its outcome is known)."""
        self.saving = None if phase == "done" else (step, phase)
        for fault in self.faults:
            if fault.kind == "slow-save" and phase != "done" or fault.kind == "slow-retention" and phase == "done":
                time.sleep((fault.ms or 0) / 1000)
            if fault.kind == "enospc" and phase == "persist" and step >= (fault.step or 0):
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            if fault.kind == "kill-during-save" and fault.phase == phase and fault.step in (None, step):
                self._fire(fault)

    def during_memory_save(self, step: int, phase: str) -> None:
        """A memory-tier save reached ``phase``: memory-enospc fails its writes."""
        for fault in self.faults:
            if fault.kind == "memory-enospc" and phase == "persist" and step >= (fault.step or 0):
                raise OSError(errno.ENOSPC, "No space left on device (injected, memory tier)")

    def _fire(self, fault: Fault) -> None:
        sys.stdout.flush()
        when = f"{fault.after:g}s after init" if fault.kind == "kill-at" else f"at step {fault.step}"
        sys.stderr.write(f"ckptrun: injected fault {fault.kind} {when}\n")
        sys.stderr.flush()
        if fault.kind == "kill-at" and self.run_dir is not None:
            saving = self.saving  # read once: the writer thread moves on until the kill lands
            records.log_event(self.run_dir, "fault_injected", kind=fault.kind, rank=self.rank, attempt=self.attempt,
                              after=fault.after, save_step=saving[0] if saving else None,
                              save_phase=saving[1] if saving else None)
        if fault.kind in ("kill", "kill-during-save", "kill-at"):
            os.kill(os.getpid(), 9)
        elif fault.kind == "exit":
            os._exit(fault.code)
        elif fault.kind == "hang":
            while True:
                time.sleep(3600)


def _damage(model: Any, nudge: bool) -> None:
    """Every parameter NaN, or (``nudge``) the first element of the first parameter one ulp up."""
    import torch

    with torch.no_grad():
        for param in model.parameters():
            local = param.data.to_local() if hasattr(param.data, "to_local") else param.data  # a DTensor's own shard
            if not local.numel():
                continue
            flat = local.view(-1)
            if nudge:
                flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=flat.dtype))
                return
            flat.fill_(float("nan"))
