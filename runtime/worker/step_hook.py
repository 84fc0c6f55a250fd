"""Zero-code supervision: torch's global optimizer-step hook makes any script's steps visible.

The worker bootstrap wraps every rank, plain scripts included. It asks to be
told when ``torch.optim.optimizer`` is first executed (a meta-path finder
that wraps that one module's loader), then registers
``register_optimizer_step_post_hook``: nothing is imported eagerly, and a
script that never imports torch pays nothing. Each optimizer step then
counts a step, beats this rank's heartbeat (C3, ``source="step-hook"``,
throttled to the heartbeat interval), logs a step record on rank 0 each time
it beats (so the supervisor, ``status`` and ``report`` see progress; no loss:
the script keeps its loss to itself) and fires the step faults of C1
(``kill``/``hang``/``exit``). Once the runtime has its own heartbeater
(``init()``) the hook does nothing: the runtime's steps are authoritative.

The step it reports is the *global* one, read from the optimizer: the ``step`` that Adam-like optimizers
keep in their state, else a counter ckptrun keeps in the first param group (``ckptrun_step``, a 0-dim
tensor updated in place, so compiled steps see no new value to guard on). Both travel in the optimizer's
``state_dict``, so a script that resumes from its own checkpoint continues the count and one that started
over shows step 1 again (the supervisor says so: ``started_over``). Importable without torch.
"""

from __future__ import annotations

import atexit
import importlib.abc
import os
import sys
import time
from types import ModuleType
from typing import Any, Callable, Sequence

from ckptrun.runtime import records
from ckptrun.runtime.env import EnvError, RunEnv
from ckptrun.runtime.worker.fault_injection import FaultInjector
from ckptrun.runtime.faults import FaultSpecError, parse_faults
from ckptrun.runtime.worker.liveness import Heartbeater

OPTIMIZER_MODULE = "torch.optim.optimizer"
SOURCE = "step-hook"


class AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``then(module)`` right after module ``name`` first executes; stays out of every other import."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once: the real finders do the work
        spec = next((s for f in sys.meta_path if (s := _spec(f, fullname, path, target)) is not None), None)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        def exec_then(module: ModuleType) -> None:
            execute(module)
            self.then(module)

        spec.loader.exec_module = exec_then  # type: ignore[method-assign]
        return spec


def _spec(finder: Any, fullname: str, path: Sequence[str] | None, target: ModuleType | None) -> Any:
    find = getattr(finder, "find_spec", None)
    return find(fullname, path, target) if find is not None else None


class StepHook:
    """Counts this rank's optimizer steps and turns them into heartbeats, step records and step faults."""

    def __init__(self, env: RunEnv, rank: int) -> None:
        self.env, self.rank = env, rank
        self.heart = Heartbeater(env.run_dir, rank, env.attempt, env.heartbeat_interval, source=SOURCE)
        self.faults = FaultInjector(parse_faults(env.fault), rank, env.attempt)
        self.counts: dict[int, int] = {}  # per optimizer: a GAN's two optimizers make one step, not two
        self.step = self.logged = 0
        self.returned = False  # the script returned (bootstrap): the exit beat says so
        atexit.register(self.finish)

    def __call__(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if Heartbeater.runtime_active:
            return
        self.counts[id(optimizer)] = global_step(optimizer)
        self.step = max(self.counts.values())
        due = self.faults.step_fault_due(self.step)
        hangs = due and self.faults.hang_due(self.step)  # its step, at its last beat's time: not alive
        if self.heart.beat(self.step, "train", force=due, stale=hangs):
            self._log_step()  # forced before a fault: the records show the step it hit
        self.faults.after_step(self.step)

    def _log_step(self) -> None:
        """Rank 0's step record, each time it beats (and before a fault, so the record shows the step it hit)."""
        if self.rank == 0 and self.step > self.logged:
            self.logged = self.step
            records.log_metrics(self.env.run_dir, {"step": self.step, "attempt": self.env.attempt,
                                                   "time": time.time(), "source": SOURCE})

    def finish(self) -> None:
        """At exit: the last step counted, whatever the throttle held back."""
        if self.step and not Heartbeater.runtime_active:
            self.heart.beat(self.step, "returned" if self.returned else "done", force=True)
            self._log_step()

    def script_returned(self) -> None:
        """The script returned without an error: beat ``returned`` now, before the interpreter's teardown (a
        process group's threads can abort it, or make it slow, after the last step: not a crash, not a hang)."""
        self.returned = True
        self.finish()


COUNTER = "ckptrun_step"


def global_step(optimizer: Any) -> int:
    """The optimizer's own step count after this step: Adam-like ``state[p]["step"]`` (on the CPU: reading a
    device tensor would wait for the device), else ckptrun's counter in the first param group."""
    first = next(iter(optimizer.state.values()), None)  # every parameter steps together: one read per step
    known = _number(first["step"]) if isinstance(first, dict) and "step" in first else None
    group = optimizer.param_groups[0]
    counter = group.get(COUNTER)
    if known is not None and counter is None:
        return known
    if counter is None:
        import torch

        counter = group[COUNTER] = torch.zeros((), dtype=torch.int64)
    counter.add_(1)
    return int(counter)


def _number(value: Any) -> int | None:
    if isinstance(value, (int, float)):
        return int(value)
    device = getattr(value, "device", None)
    return int(value.item()) if device is not None and device.type == "cpu" else None


def install() -> None:
    """Register the hook as soon as the script imports torch (now, if it already has)."""
    if OPTIMIZER_MODULE in sys.modules:
        register(sys.modules[OPTIMIZER_MODULE])
    else:
        sys.meta_path.insert(0, AfterImport(OPTIMIZER_MODULE, register))


def register(module: ModuleType) -> None:
    """Register the step hook (only under ``ckptrun launch``: a bad C1 is left for ``init()`` to report)."""
    try:
        env = RunEnv.from_env()
        hook = StepHook(env, int(os.environ.get("RANK", "0")))
    except (EnvError, FaultSpecError, ValueError, OSError) as exc:
        print(f"ckptrun: optimizer steps are not watched: {exc}", file=sys.stderr, flush=True)
        return
    if env.supervised:
        module.register_optimizer_step_post_hook(hook)
        HOOKS.append(hook)


HOOKS: list[StepHook] = []  # the registered hook (one per process), told when the script returns


def script_returned() -> None:
    """Called by the bootstrap when the user's script returned (or exited 0)."""
    for hook in HOOKS:
        hook.script_returned()
