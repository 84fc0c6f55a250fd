"""When and how each forked rank ended (warm workers): what torch's fork start does not report.

With warm workers (``runtime/worker/warm_start.py``) torchrun starts its ranks through torch's
``MultiprocessContext``, which reports only the first failed rank it happens to see: when a rank is
SIGKILLed, the survivors fail a moment later in their collectives, and torch may name one of them.
Spawned ranks (``SubprocessContext``) report every rank, and the supervisor picks the earliest
(:func:`ckptrun.cli.supervision.failures.root_cause`). So the agent watches its forked ranks itself: a
thread per rank (found by its pid file) blocks in ``waitid(..., WNOWAIT)``, which returns the moment the
rank exits without reaping it (torch still does), and notes its exit status and time. When torchrun
gives up, :meth:`RankEnds.complete` adds the ranks torch left out (with their error files) and stamps a
rank killed by a signal with the whole second it died, as torchrun stamps a spawned one: a killed rank's
sockets close before it is seen to exit, so its peers' "connection closed" errors carry times a few
milliseconds *before* its exit is seen; the whole second lets it win, as it does for spawned ranks
(:func:`~ckptrun.cli.supervision.failures.root_cause` breaks ties for the rank with no SIGTERM, earliest
first). Runs in the agent process only.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from ckptrun.cli.supervision.failures import RankFailure, from_error_file

SCAN_S = 0.05  # how often the pid directory is read for new ranks


def exit_code(result: Any) -> int:
    """torchrun's convention: the exit status, or minus the signal that killed it."""
    if result.si_code == os.CLD_EXITED:
        return int(result.si_status)
    return -int(result.si_status)


class RankEnds:
    """The end (exit code, time) of every forked rank of this attempt, as it happens."""

    def __init__(self, pid_dir: Path) -> None:
        self.pid_dir = pid_dir
        self.facts: dict[int, dict[str, Any]] = {}  # rank -> its pid file
        self.ended: dict[int, tuple[int | None, float]] = {}  # rank -> (exit code, None once reaped elsewhere; time)

    def start(self) -> None:
        threading.Thread(target=self._scan, name="ckptrun-rank-ends", daemon=True).start()

    def _scan(self) -> None:
        while True:
            for path in self.pid_dir.glob("rank-*.json"):
                try:
                    facts = json.loads(path.read_text())
                except (OSError, ValueError):
                    continue
                if facts.get("rank") not in self.facts:
                    self.facts[facts["rank"]] = facts
                    threading.Thread(target=self._wait, args=(facts,), name=f"ckptrun-rank-{facts['rank']}-end",
                                     daemon=True).start()
            time.sleep(SCAN_S)

    def _wait(self, facts: dict[str, Any]) -> None:
        try:
            result = os.waitid(os.P_PID, int(facts["pid"]), os.WEXITED | os.WNOWAIT)
            code = exit_code(result) if result is not None else None
        except ChildProcessError:  # torch reaped it first: the time is still close
            code = None
        self.ended[int(facts["rank"])] = (code, time.time())

    def complete(self, failures: list[RankFailure]) -> list[RankFailure]:
        """``failures`` (what torch reported) plus every other rank that ended with a non-zero code; a rank
        without an error file (killed by a signal) gets the time it died."""
        reported = {f.rank for f in failures}
        out = list(failures)
        for rank, (code, ended) in sorted(self.ended.items()):
            if rank not in reported and code not in (None, 0):
                out.append(self._failure(rank, code))
        for failure in out:  # no error file: the second it died, stamped as torchrun stamps a spawned rank's
            if failure.exception is None and failure.rank in self.ended:
                failure.time = float(int(self.ended[failure.rank][1]))
        return out

    def _failure(self, rank: int, code: int) -> RankFailure:
        error_file = self.facts[rank].get("error_file")
        try:
            data = json.loads(Path(error_file).read_text()) if error_file else None
        except (OSError, ValueError):
            data = None
        return from_error_file(rank, code, error_file, data if isinstance(data, dict) else None)
