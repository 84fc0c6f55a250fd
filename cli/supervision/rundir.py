"""The run directory's layout on the supervisor side, and its one-writer lock.

``RUN_DIR/.lock`` is a :mod:`filelock` lock (``flock``): the kernel drops it
when its holder dies, so the lock of a SIGKILLed supervisor is simply taken
over by the next launcher. ``RUN_DIR/supervisor.json`` names the holder (pid,
start time, command) so that a refused launcher and ``ckptrun stop`` can say
who holds the run. Records inside the run dir (events, metrics, heartbeats)
keep their formats in :mod:`ckptrun.runtime.records`. Importable without torch.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from filelock import FileLock, Timeout

from ckptrun.cli.errors import EXIT_REFUSED, CkptrunError
from ckptrun.cli.store_location import redact_argv
from ckptrun.cli.supervision.spec import RUN_JSON
from ckptrun.runtime import records

LOCK_NAME = ".lock"
HOLDER_NAME = "supervisor.json"
STOP_NAME = "stop"  # the workers' stop channel (ckptrun.runtime.step.session checks RUN_DIR/stop)
RUNS_ROOT = Path("runs")


@dataclass(frozen=True)
class RunPaths:
    """Where things live in one run directory."""

    root: Path

    @property
    def run_json(self) -> Path:
        return self.root / RUN_JSON

    @property
    def stop_file(self) -> Path:
        return self.root / STOP_NAME

    @property
    def logs(self) -> Path:
        return self.root / records.LOGS

    def attempt_logs(self, attempt: int) -> Path:
        return self.logs / f"attempt-{attempt}"

    @property
    def lock_file(self) -> Path:
        return self.root / LOCK_NAME

    @property
    def holder_file(self) -> Path:
        return self.root / HOLDER_NAME


def holder(paths: RunPaths) -> dict[str, Any] | None:
    """The supervisor recorded as holding the run, if that process is still alive."""
    return _live_holder(paths.holder_file)


def node_holders(root: Path) -> dict[int, dict[str, Any]]:
    """A many-node run's launchers, by node rank, as each recorded itself in ``nodes/node-K/supervisor.json``
    (one writer per file); ``alive`` is True or False on the launcher's own host, None elsewhere."""
    found = {}
    for path in sorted(root.glob(f"nodes/node-*/{HOLDER_NAME}")):
        info = _read_json(path)
        if info is None or not path.parent.name.removeprefix("node-").isdigit():
            continue
        here = info.get("host") in (None, socket.gethostname())
        info["alive"] = _live_holder(path) is not None if here else None
        found[int(path.parent.name.removeprefix("node-"))] = info
    return found


def _live_holder(path: Path) -> dict[str, Any] | None:
    try:
        info = json.loads(path.read_text())
        if alive(int(info["pid"]), float(info["start_time"])):
            return info
    except (OSError, ValueError, KeyError, TypeError, psutil.Error):
        pass
    return None


def alive(pid: int, start_time: float) -> bool:
    """The process ``pid`` started at ``start_time`` still runs (pid reuse and zombies count as gone)."""
    try:
        process = psutil.Process(pid)
        return abs(process.create_time() - start_time) < 1.0 and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class RunLock:
    """Exclusive hold on a run directory for one supervisor; refuses with exit 2 naming the holder."""

    def __init__(self, paths: RunPaths) -> None:
        self.paths = paths
        self.lock = FileLock(str(paths.lock_file), timeout=0)
        self.took_over: dict[str, Any] | None = None

    def acquire(self) -> "RunLock":
        self.paths.root.mkdir(parents=True, exist_ok=True)
        stale = _read_json(self.paths.holder_file)
        try:
            self.lock.acquire()
        except Timeout:
            who = holder(self.paths) or stale or {}
            pid = who.get("pid", "unknown")
            raise CkptrunError(f"run directory {self.paths.root} is in use by supervisor pid {pid}",
                               f"wait for it, stop it with `ckptrun stop {self.paths.root}`, or use another --name/--run-dir",
                               EXIT_REFUSED) from None
        if stale is not None:
            self.took_over = stale
        me = psutil.Process()
        info = {"pid": me.pid, "start_time": me.create_time(), "argv": redact_argv(sys.argv), "time": time.time(),
                "host": socket.gethostname()}
        tmp = self.paths.holder_file.with_name(f".{HOLDER_NAME}.tmp")
        tmp.write_text(json.dumps(info))
        os.replace(tmp, self.paths.holder_file)
        return self

    def release(self) -> None:
        try:
            self.paths.holder_file.unlink()
        except FileNotFoundError:
            pass
        self.lock.release()

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
        return value if isinstance(value, dict) else None
    except (OSError, ValueError):
        return None


def latest_run(root: Path = RUNS_ROOT, pass_as: str = "--run-dir RUN_DIR") -> Path:
    """The run under ``root`` that started last (``run.json``'s ``created``), for a command without a path.

    By start time, never by mtime: reading an old run (``report`` writes into it) must not make it the
    newest. ``pass_as`` is how the calling command takes a run, so that the hint names an option it has.
    """
    candidates = [p.parent for p in root.glob(f"*/{RUN_JSON}")]
    if not candidates:
        raise CkptrunError(f"no runs under {root}/", f"pass {pass_as} (or run from the directory that holds runs/)")
    return max(candidates, key=_started)


def _started(run_dir: Path) -> float:
    """When the run was created, from its run.json (its mtime for a record without the field)."""
    record = _read_json(run_dir / RUN_JSON) or {}
    created = record.get("created")
    return float(created) if isinstance(created, (int, float)) else (run_dir / RUN_JSON).stat().st_mtime


def default_name(script: Path | None) -> str:
    stem = script.stem if script else "default_job"
    return f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def unique_run_dir(root: Path, name: str) -> Path:
    """``root/name``, or ``root/name-2``… when a default name collides within the same second."""
    candidate, index = root / name, 2
    while (candidate / RUN_JSON).exists():
        candidate, index = root / f"{name}-{index}", index + 1
    return candidate
