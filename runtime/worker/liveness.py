"""A worker's signs of life and its watch on the supervisor.

Heartbeats are written from the training thread on purpose: a rank stuck in a
collective or a hung data loader stops beating, which is what the supervisor's
hang detection needs. A beat is one clock read, and once an interval one
``pwrite`` into the rank's file kept open (:class:`~ckptrun.runtime.records.HeartbeatFile`):
a few microseconds, so the training thread can afford it. The supervisor watchdog is a daemon thread: when the
supervisor is gone (pid dead, or reused by another process) the worker exits,
so a SIGKILLed supervisor leaves no orphans.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable, ClassVar

from ckptrun.runtime.records import Heartbeat, HeartbeatFile, Phase, Source

STACK_DUMP_SIGNAL = signal.SIGUSR2
SUPERVISOR_GONE_EXIT = 75
_watching = False


class Heartbeater:
    """Writes this rank's heartbeat at most every ``interval`` seconds, and on every phase change.

    The runtime's heartbeater is authoritative: once one exists, the bootstrap's optimizer-step hook
    (``source="step-hook"``, :mod:`ckptrun.runtime.worker.step_hook`) stays silent, so step numbers never conflict.
    """

    runtime_active: ClassVar[bool] = False

    def __init__(self, run_dir: Path, rank: int, attempt: int, interval: float, source: Source = "runtime") -> None:
        self.run_dir, self.rank, self.attempt, self.interval, self.source = run_dir, rank, attempt, interval, source
        self.phase: Phase | None = None
        self.last = 0.0
        (run_dir / "heartbeats").mkdir(parents=True, exist_ok=True)
        self._file: HeartbeatFile | None = None  # opened at the first beat
        if source != "step-hook":  # the runtime's or an integration's steps are the global ones
            Heartbeater.runtime_active = True

    def beat(self, step: int, phase: Phase, force: bool = False, stale: bool = False) -> bool:
        """True when a heartbeat was written (not throttled). ``stale``: record the step but keep the last
        beat's time (an injected hang: the records show the step it hit, and the rank does not look alive)."""
        now = time.time()
        if not force and phase == self.phase and now - self.last < self.interval:
            return False
        if stale and self.last:
            now = self.last
        self.phase, self.last = phase, now
        if self._file is None:
            self._file = HeartbeatFile(self.run_dir, self.rank)
        self._file.write(Heartbeat(rank=self.rank, pid=os.getpid(), attempt=self.attempt, step=step, phase=phase,
                                   time=now, source=self.source))
        return True


def enable_stack_dumps() -> None:
    """On SIGUSR2, print every thread's Python stack to stderr (the rank's log) — used before a hang kill."""
    faulthandler.register(STACK_DUMP_SIGNAL, file=sys.stderr, all_threads=True, chain=False)


def supervisor_alive(pid: int, start_time: float | None) -> bool:
    """A zombie is dead: a SIGKILLed supervisor whose parent has not reaped it yet (a test, a shell, a container
    entry point that never waits) still has a pid and a create time, and its workers must not wait for it."""
    import psutil

    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        return start_time is None or abs(process.create_time() - start_time) < 1.0
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def watch_supervisor(pid: int | None, start_time: float | None, period: float = 1.0,
                     on_gone: Callable[[], None] | None = None) -> None:
    """Exit this process within ``period`` seconds of the supervisor's death (``on_gone`` first: the torchrun
    wrapper kills its ranks). One watch per process: the bootstrap starts it for every script, so the
    runtime's ``init()`` finds it running."""
    global _watching
    if pid is None or _watching:
        return
    _watching = True

    def loop() -> None:
        while True:
            time.sleep(period)
            if not supervisor_alive(pid, start_time):
                sys.stderr.write(f"ckptrun: supervisor {pid} is gone; exiting\n")
                sys.stderr.flush()
                if on_gone is not None:
                    on_gone()
                os._exit(SUPERVISOR_GONE_EXIT)

    threading.Thread(target=loop, name="ckptrun-supervisor-watch", daemon=True).start()


def _forget_watch() -> None:
    global _watching
    _watching = False


os.register_at_fork(after_in_child=_forget_watch)  # a forked process (a warm rank) has no watch thread: it starts its own
