"""Per-rank failure facts of one attempt, as torchrun recorded them — never scraped from logs.

``ckptrun.cli.supervision.agent`` runs torchrun and, when it raises ``ChildFailedError``,
writes ``failures.json`` in the attempt's log directory from
``ChildFailedError.failures``: each failed rank's exit code or signal and the
contents of its error file (the exception and traceback the worker bootstrap
recorded). This module owns that file's format and turns it into the root
cause a person reads first: the earliest failing rank, how it died, why.
Importable without torch.
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

FAILURES_NAME = "failures.json"
CONSOLE_NAME = "console.log"
PLACEHOLDERS = ("<NONE>", "<N/A>", "")  # torchrun's words for "no error file"
TAIL_LINES, TAIL_BYTES = 6, 4096


@dataclass
class RankFailure:
    """How one rank (or torchrun itself, ``rank=None``) ended an attempt."""

    rank: int | None
    exit_code: int | None = None
    signal: str | None = None
    exception: str | None = None
    traceback: str | None = None
    time: float | None = None
    phase: str | None = None  # "load": the script never started; "run": it failed while running
    uses_runtime: bool | None = None  # the script imports ckptrun.runtime (or had loaded it when it failed)
    log: str | None = None
    stderr_tail: list[str] | None = None  # the rank's last lines of stderr: the argparse message, the exception

    def describe(self) -> str:
        """One line: who, how, why (the exception if there is one)."""
        who = f"rank {self.rank}" if self.rank is not None else "torchrun"
        if self.exception:
            return f"{who}: {self.exception}"
        if self.signal:
            return f"{who} was killed by {self.signal}"
        if self.exit_code is not None:
            return f"{who} exited with code {self.exit_code}"
        return f"{who} ended for an unknown reason"

    def to_json(self) -> dict[str, Any]:
        """Fields for the failure event (``time`` is the event's own, so the failure's is ``failed_at``)."""
        fields = {k: v for k, v in asdict(self).items() if k not in ("traceback", "time")}
        return {**fields, "failed_at": self.time}


def signal_name(exit_code: int) -> str | None:
    """torchrun reports death by signal N as exit code -N."""
    if exit_code >= 0:
        return None
    try:
        return signal.Signals(-exit_code).name
    except ValueError:
        return f"signal {-exit_code}"


def from_error_file(rank: int, exit_code: int, error_file: str | None, data: dict[str, Any] | None) -> RankFailure:
    """Build a rank's facts from torchrun's exit code and its error-file JSON (if the worker wrote one)."""
    failure = RankFailure(rank=rank, exit_code=exit_code, signal=signal_name(exit_code))
    message = (data or {}).get("message")
    if message in PLACEHOLDERS:
        message = None
    if isinstance(message, dict):
        extra = message.get("extraInfo") or {}
        failure.exception = message.get("message")
        failure.traceback = extra.get("py_callstack")
        failure.phase = extra.get("ckptrun_phase")
        failure.uses_runtime = extra.get("ckptrun_runtime")
        stamp = extra.get("time") or extra.get("timestamp")
        failure.time = float(stamp) if stamp else None
    elif isinstance(message, str):
        failure.exception = message
    if error_file and error_file not in PLACEHOLDERS:
        failure.log = str(Path(error_file).with_name("stderr.log"))
    return failure


def write_failures(path: Path, failures: list[RankFailure], agent_error: str | None = None) -> None:
    """Written once by the agent when torchrun gives up; replaced atomically."""
    document = {"failures": [asdict(f) for f in failures], "agent_error": agent_error}
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(document, indent=1))
    os.replace(tmp, path)


def read_failures(attempt_dir: Path) -> tuple[list[RankFailure], str | None]:
    """The attempt's rank failures and torchrun's own error, or ``([], None)`` when none was recorded."""
    try:
        document = json.loads((attempt_dir / FAILURES_NAME).read_text())
    except (OSError, ValueError):
        return [], None
    failures = [RankFailure(**record) for record in document.get("failures", [])]
    return failures, document.get("agent_error")


def root_cause(failures: list[RankFailure]) -> RankFailure | None:
    """The earliest failing rank. A SIGTERM comes last (that is torchrun tearing the others down), and
    on a tie (torchrun's timestamps are whole seconds) a rank with an exception wins over one without."""
    if not failures:
        return None
    return min(failures, key=lambda f: (f.signal == "SIGTERM", f.time if f.time is not None else float("inf"),
                                        f.exception is None, f.rank if f.rank is not None else -1))


def rank_log(attempt_dir: Path, local_rank: int, stream: str = "stderr") -> Path | None:
    """``stdout.log``/``stderr.log`` of a rank (torchrun's ``--log-dir`` layout, one level of run id)."""
    linked = attempt_dir / f"rank-{local_rank}" / f"{stream}.log"
    if linked.exists():
        return linked
    found = sorted(attempt_dir.glob(f"*/attempt_*/{local_rank}/{stream}.log"))
    return found[-1] if found else None


def stderr_tail(log: Path | None, lines: int = TAIL_LINES) -> list[str] | None:
    """The last non-blank lines a rank wrote to stderr, without the traceback header (the log has it all)."""
    try:
        with open(log, "rb") as stream:  # type: ignore[arg-type]
            stream.seek(max(0, stream.seek(0, os.SEEK_END) - TAIL_BYTES))
            text = stream.read().decode(errors="replace")
    except (OSError, TypeError):
        return None
    kept = [line.rstrip() for line in text.splitlines() if line.strip() and not line.startswith("Traceback (most recent")]
    return kept[-lines:] or None


def describe_failure(failure: dict[str, Any]) -> str:
    """One line for a person: root cause first (another node's, when the job agreed on one; then this one's)."""
    if failure.get("root_cause"):
        return describe_root(failure["root_cause"]) + (f"; here: {failure['collateral']}" if failure.get("collateral") else "")
    if failure.get("cause") == "hang":
        suspect = failure.get("suspect")
        # every rank goes silent within milliseconds of a hang: the first past the timeout is often a peer that
        # waits for the suspect, so say why the suspect is blamed
        why = ", not waiting on its peers" if (failure.get("waiting_on_peers") or {}).get(str(suspect)) is False else ""
        return (f"ranks {failure.get('stale_ranks')} stopped making progress (suspect: rank {suspect}{why}; "
                f"phase {failure.get('phase')}, step {failure.get('step')})")
    facts = RankFailure(rank=failure.get("rank"), exit_code=failure.get("exit_code"), signal=failure.get("signal"),
                        exception=failure.get("exception"))
    step = failure.get("step")
    return facts.describe() + (f" (last step {step})" if step is not None else "")


def describe_root(root: dict[str, Any]) -> str:
    """The job's first failure (as :meth:`JobStore.report_failure` recorded it), named by its node."""
    node, cause = f"node {root.get('node')}", root.get("cause")
    if cause == "hang":
        return f"{node}: ranks {root.get('ranks')} stopped making progress (suspect: rank {root.get('rank')})"
    if cause == "node lost":
        return f"{node} was lost ({root.get('detail') or 'its supervisor stopped beating'})"
    facts = RankFailure(rank=root.get("rank"), exit_code=root.get("exit_code"), signal=root.get("signal"),
                        exception=root.get("exception"))
    step = root.get("step")
    return f"{node}, {facts.describe()}" + (f" (last step {step})" if step is not None else "")
