"""Fires the test faults that C1's ``fault`` field names, at the points the spec says (see runtime.faults)."""

from __future__ import annotations

import errno
import os
import sys
import time
from typing import Any

from ckptrun.runtime.faults import Fault


class FaultInjector:
    """Fires the test faults of C1 at the points the spec names (see runtime.faults)."""

    def __init__(self, faults: list[Fault], rank: int, attempt: int) -> None:
        self.faults = [f for f in faults if f.applies(rank, attempt)]
        self.fired: set[int] = set()  # each fault fires once per process

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

    def during_save(self, step: int, phase: str) -> None:
        for fault in self.faults:
            if fault.kind == "enospc" and phase == "persist" and step >= (fault.step or 0):
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            if fault.kind == "kill-during-save" and fault.phase == phase and fault.step in (None, step):
                self._fire(fault)

    def _fire(self, fault: Fault) -> None:
        sys.stdout.flush()
        sys.stderr.write(f"ckptrun: injected fault {fault.kind} at step {fault.step}\n")
        sys.stderr.flush()
        if fault.kind in ("kill", "kill-during-save"):
            os.kill(os.getpid(), 9)
        elif fault.kind == "exit":
            os._exit(fault.code)
        elif fault.kind == "hang":
            while True:
                time.sleep(3600)
