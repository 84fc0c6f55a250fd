"""One status line on stderr while a run trains: attempt, step, loss, samples/s, last snapshot, restarts,
and, once known, the RTO (measured by the last restart, estimated, budget) and the last resume's verdict.

At most once a second on a terminal (redrawn in place), every ``plain_interval``
seconds otherwise (a log file gets whole lines, not a flood). The ranks' own
lines (:meth:`Progress.echo`, from another thread) go to ``out`` — stdout, as
torchrun shows them, or stderr when stdout carries ``--json`` — after the
status line is wiped, so that neither garbles the other.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from typing import TextIO

from ckptrun.cli.durations import format_duration


@dataclass
class Status:
    attempt: int
    restarts: int
    step: int | None = None
    total: int | None = None
    loss: float | None = None
    samples_per_s: float | None = None
    snapshot_step: int | None = None
    rto_s: float | None = None  # measured by the last restart
    rto_estimate_s: float | None = None
    rto_budget_s: float | None = None
    resume: str | None = None  # the last resume's verdict (exact, within tolerance, diverged, checking)

    def rto(self) -> str | None:
        """``RTO 15.4 s (est 12.0 s, budget 30.0 s)``; None when nothing is known."""
        if self.rto_s is None and self.rto_estimate_s is None:
            return None
        known = [f"est {format_duration(self.rto_estimate_s)}"] if self.rto_estimate_s is not None else []
        known += [f"budget {format_duration(self.rto_budget_s)}"] if self.rto_budget_s is not None else []
        head = f"RTO {format_duration(self.rto_s)}" if self.rto_s is not None else known.pop(0).replace("est", "RTO est")
        return head + (f" ({', '.join(known)})" if known else "")

    def line(self) -> str:
        step = "-" if self.step is None else f"{self.step}" + (f"/{self.total}" if self.total else "")
        parts = [f"attempt {self.attempt}", f"step {step}"]
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        if self.samples_per_s is not None:
            parts.append(f"{self.samples_per_s:,.0f} samples/s")
        parts.append(f"snapshot {'-' if self.snapshot_step is None else self.snapshot_step}")
        parts.append(f"restarts {self.restarts}")
        parts += [text for text in (self.rto(), self.resume and f"resume {self.resume}") if text]
        return "ckptrun: " + " | ".join(parts)


class Progress:
    """Rate-limited status line; :meth:`say` prints narration without garbling it."""

    def __init__(self, stream: TextIO | None = None, interval: float = 1.0, plain_interval: float = 10.0,
                 enabled: bool = True, out: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.out = out or sys.stdout
        self.lock = threading.Lock()  # the rank-output thread echoes while the supervisor draws
        self.tty = self.stream.isatty()
        self.interval = interval if self.tty else plain_interval
        self.enabled = enabled
        self.last_shown = 0.0
        self.last_line = ""
        self.drawn = False

    def show(self, status: Status, force: bool = False) -> None:
        now = time.monotonic()
        line = status.line()
        with self.lock:
            if not self.enabled or line == self.last_line or (not force and now - self.last_shown < self.interval):
                return
            self.last_shown, self.last_line = now, line
            if self.tty:
                self.stream.write("\r\033[K" + line)
                self.drawn = True
            else:
                self.stream.write(line + "\n")
            self.stream.flush()

    def say(self, text: str) -> None:
        self._line(self.stream, f"ckptrun: {text}")

    def echo(self, text: str) -> None:
        """One line of a rank's output (``[rank0]:...``), on ``out``; the status line is redrawn after it.

        Into a pipe the write happens outside the lock: a reader that stalls must not stall the supervisor.
        """
        if self.out.isatty():
            self._line(self.out, text)
        else:
            self.out.write(text + "\n")
            self.out.flush()

    def _line(self, stream: TextIO, text: str) -> None:
        with self.lock:
            wiped = self.drawn
            if wiped:
                self.stream.write("\r\033[K")
                self.stream.flush()
                self.drawn = False
            stream.write(text + "\n")
            stream.flush()
            if wiped or stream is self.stream:  # the status line is due again (not a repeat in a log file)
                self.last_line = ""

    def close(self) -> None:
        with self.lock:
            if self.drawn:
                self.stream.write("\n")
                self.stream.flush()
                self.drawn = False
