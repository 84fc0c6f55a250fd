"""A duty cycle for the background writer, so that training keeps the GIL and the cores while a snapshot persists.

The writer competes with the training thread for two things: the cores and
the GIL (it runs Python between its writes: DCP's planning, ``torch.save``'s
pickler). Lowering its niceness alone backfires on the GIL: a low-priority
thread that is preempted while holding the GIL keeps the training thread
waiting until the scheduler gives it a slice again (priority inversion). So
the writer runs at normal priority and paces itself instead: after every
``chunk`` bytes it has written it sleeps ``(1 - duty) / duty`` times as long
as it was busy since its last pause, holding neither the GIL nor a core. The
sleeps bound the share of time the writer takes; the chunk bounds how long
each busy stretch is. Only the thread that entered :func:`paced` is paced
(file writers call :func:`wrote` after each write); elsewhere it is a no-op.
Importable without torch.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator

CHUNK = 4 << 20  # bytes written between pauses: one fp32 1024x1024 tensor
MAX_PAUSE_S = 0.05  # a busy stretch inflated by a loaded machine does not stop the writer for long

_local = threading.local()


class Pacer:
    """Sleeps after every ``chunk`` bytes so the thread is busy at most ``duty`` of the time (wall clock)."""

    def __init__(self, duty: float, chunk: int | None = None) -> None:
        if not 0.0 < duty <= 1.0:
            raise ValueError(f"pacing duty {duty!r} must be in (0, 1]; 1 means no pauses")
        self.ratio, self.chunk = (1.0 - duty) / duty, CHUNK if chunk is None else chunk
        self.pending = 0  # bytes written since the last pause
        self.resumed = time.perf_counter()
        self.paused_s = 0.0  # total sleep, for the save's accounting and for tests

    def wrote(self, count: int) -> None:
        self.pending += count
        if self.pending < self.chunk or self.ratio == 0.0:
            return
        busy = time.perf_counter() - self.resumed
        pause = min(busy * self.ratio, MAX_PAUSE_S)
        time.sleep(pause)
        self.paused_s += pause
        self.pending, self.resumed = 0, time.perf_counter()


@contextlib.contextmanager
def paced(duty: float, chunk: int | None = None) -> Iterator[Pacer]:
    """Pace this thread's file writes (see the module docstring) until the block ends."""
    previous = getattr(_local, "pacer", None)
    _local.pacer = pacer = Pacer(duty, chunk)
    try:
        yield pacer
    finally:
        _local.pacer = previous


def wrote(count: int) -> None:
    """Called by file writers after each write of ``count`` bytes: pauses when this thread is paced and due."""
    pacer = getattr(_local, "pacer", None)
    if pacer is not None:
        pacer.wrote(count)
