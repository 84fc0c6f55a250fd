"""The ranks' output on the launcher's terminal, as torchrun shows it: each line prefixed ``[rankN]:``.

torchrun already tees every rank's stdout and stderr into the attempt's
``console.log`` (``--tee 3``), each line prefixed by
:data:`PREFIX_TEMPLATE` (torchrun's ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``).
A thread follows that file and copies the chosen ranks' lines to the
launcher's terminal; torchrun's own log lines (no rank prefix) stay in the
file. Following a file rather than a pipe is what keeps a slow or blocked
terminal from ever slowing the ranks: torchrun and the ranks write to a file,
and only this thread waits. Importable without torch.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Callable

PREFIX_TEMPLATE = "[rank${rank}]:"  # ${rank}: the global rank, substituted by torchrun
PREFIX_VARIABLE = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
RANK_LINE = re.compile(rb"^\[rank(\d+)\]:")
POLL_S = 0.1


def selector(choice: str) -> Callable[[int], bool] | None:
    """``all``, ``none`` or ``0,3`` (the spec validated it) → which ranks to show; None shows nothing."""
    if choice == "none":
        return None
    if choice == "all":
        return lambda rank: True
    chosen = {int(part) for part in choice.split(",")}
    return chosen.__contains__


class RankOutput:
    """Follows one attempt's console.log from its current end; :meth:`stop` copies what is left and ends."""

    def __init__(self, console_log: Path, show: Callable[[int], bool], write: Callable[[str], None]) -> None:
        self.path, self.show, self.write = console_log, show, write
        self.offset = console_log.stat().st_size if console_log.exists() else 0
        self.finished = threading.Event()
        self.thread = threading.Thread(target=self._follow, name="ckptrun-rank-output", daemon=True)
        self.thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Copy the lines written so far, then end the thread (a terminal that never drains: after ``timeout``)."""
        self.finished.set()
        self.thread.join(timeout)

    def _follow(self) -> None:
        pending = b""
        while True:
            stopping = self.finished.is_set()  # then read to the end once more: the writers have stopped
            chunk = self._read()
            lines = (pending + chunk).split(b"\n")
            pending = lines.pop()
            try:
                for line in lines:
                    self._copy(line)
                if stopping and not chunk:
                    self._copy(pending)
                    return
            except (OSError, ValueError):  # the terminal went away (closed pipe): nothing more to show
                return
            if not chunk:
                self.finished.wait(POLL_S)

    def _read(self) -> bytes:
        try:
            with open(self.path, "rb") as stream:
                stream.seek(self.offset)
                data = stream.read(1 << 20)
        except FileNotFoundError:
            return b""
        self.offset += len(data)
        return data

    def _copy(self, line: bytes) -> None:
        found = RANK_LINE.match(line)
        if found and self.show(int(found.group(1))):
            self.write(line.decode(errors="replace").rstrip("\r"))
