"""Contract C3: the run directory's shared records — heartbeats, events, metrics.

Several processes append to the same JSONL file, so every append is one
``O_APPEND`` write of one whole line (atomic for small writes on a local file
system), and every reader tolerates a torn last line left by a process killed
mid-write. ``O_APPEND`` is atomic on one machine only, not across NFS clients:
on many nodes ``events.jsonl`` is written from the leader's node (node rank 0)
only; the others write their events to ``nodes/node-K/events.jsonl`` (their
launcher, and their ranks by C1's ``CKPTRUN_NODE``), and :func:`read_events`
merges them. ``fatal.json`` (JSONL too: a line per refusing rank) is split the same way:
:func:`write_fatal` appends to this node's file, :func:`read_fatal` merges them.
``metrics.jsonl`` has one writer wherever it runs (global rank 0).
Heartbeats are one small file per rank, rewritten in place by its rank
(:class:`HeartbeatFile`); readers skip one caught half written.
Importable without torch.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Iterator, Literal

from pydantic import BaseModel, ConfigDict

EVENTS = "events.jsonl"
METRICS = "metrics.jsonl"
OWN_LOSSES = "losses-rank0.jsonl"  # rank 0's own loss, a line as each step ends: what a resume is checked against
HEARTBEATS = "heartbeats"
LOGS = "logs"
FATAL = "fatal.json"

Phase = Literal["init", "restore", "train", "save", "done", "stopping", "returned"]  # returned: a plain
# script returned (its interpreter is exiting): what happens to the process after it is teardown, not training
Source = Literal["runtime", "step-hook", "framework"]  # who beat: the runtime, the bootstrap's optimizer-step hook
#   (a plain script), or a framework integration (ckptrun.integrations: Lightning, HF Trainer; its global step)


def _default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one record as a single O_APPEND write (floats keep full precision via repr)."""
    line = (json.dumps(record, default=_default, allow_nan=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


class JsonlAppender:
    """One process's stream of records into one JSONL file (metrics: a line per step), each still one
    ``O_APPEND`` write of a whole line; the file stays open, so a line costs one ``write`` instead of
    ``open``+``write``+``close`` (about 40% less per line here, most of what is left is ``json.dumps``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def append(self, record: dict[str, Any]) -> None:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        os.write(self._fd, (json.dumps(record, default=_default, allow_nan=True) + "\n").encode())

    def append_many(self, records: list[dict[str, Any]]) -> None:
        """Several whole lines in one ``O_APPEND`` write (a batch of steps whose mean losses arrived together)."""
        if records:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            os.write(self._fd, "".join(json.dumps(r, default=_default, allow_nan=True) + "\n" for r in records).encode())

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """All whole records of a JSONL file; a torn or garbled line is skipped."""
    return list(iter_jsonl(path))


def iter_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    for raw in data.split(b"\n"):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except ValueError:
            continue
        if isinstance(record, dict):
            yield record


NODE_VARIABLE = "CKPTRUN_NODE"  # contract C1's RunEnv.node: the node whose launcher started this rank


def node_file(run_dir: Path, name: str, writer_node: int | None = None) -> Path:
    """The copy of the shared record file ``name`` a writer on ``writer_node`` appends to (default: this
    process's node from C1): ``RUN_DIR/name`` on the leader's node or a single node, ``nodes/node-K/name``
    elsewhere, so that each file has one node writing it."""
    if writer_node is None:
        text = os.environ.get(NODE_VARIABLE, "")
        writer_node = int(text) if text.isdigit() else None
    return run_dir / name if not writer_node else run_dir / "nodes" / f"node-{writer_node}" / name


def events_file(run_dir: Path, writer_node: int | None = None) -> Path:
    """The events file a writer on ``writer_node`` appends to: ``events.jsonl`` or ``nodes/node-K/events.jsonl``."""
    return node_file(run_dir, EVENTS, writer_node)


def read_merged(run_dir: Path, name: str) -> list[dict[str, Any]]:
    """The records of the shared file ``name`` with every node's ``nodes/node-K/name`` merged in by time."""
    records = read_jsonl(run_dir / name)
    others = sorted(run_dir.glob(f"nodes/node-*/{name}"))
    if others:
        records = sorted(records + [r for path in others for r in read_jsonl(path)], key=_event_time)
    return records


def log_event(run_dir: Path, event: str, *, writer_node: int | None = None, **fields: Any) -> dict[str, Any]:
    """Append an event (``event`` is its type, ``time`` unix seconds) to this node's events file."""
    record = {"event": event, "time": time.time(), **fields}
    path = events_file(run_dir, writer_node)
    path.parent.mkdir(parents=True, exist_ok=True)
    append_jsonl(path, record)
    return record


def read_events(run_dir: Path, event: str | None = None) -> list[dict[str, Any]]:
    """The run's events: the shared file, with the other nodes' files merged in by time (one node: just it)."""
    return [r for r in read_merged(run_dir, EVENTS) if event is None or r.get("event") == event]


def _event_time(record: dict[str, Any]) -> float:
    value = record.get("time")
    return float(value) if isinstance(value, (int, float)) else 0.0


def log_metrics(run_dir: Path, record: dict[str, Any]) -> None:
    append_jsonl(run_dir / METRICS, record)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    return read_jsonl(run_dir / METRICS)


def losses_by_attempt(run_dir: Path) -> dict[int, dict[int, float]]:
    """{attempt: {step: loss}} from metrics.jsonl, for exactness checks and the resume verdict."""
    table: dict[int, dict[int, float]] = {}
    for record in read_metrics(run_dir):
        if "loss" in record and "step" in record:
            table.setdefault(int(record.get("attempt", 1)), {})[int(record["step"])] = float(record["loss"])
    return table


def final_losses(run_dir: Path) -> dict[int, float]:
    """{step: loss} as the run finally saw it: later attempts overwrite replayed steps."""
    merged: dict[int, float] = {}
    for attempt in sorted(losses_by_attempt(run_dir)):
        merged.update(losses_by_attempt(run_dir)[attempt])
    return merged


def same_float(a: float, b: float) -> bool:
    """Bitwise float equality that also treats NaN == NaN."""
    return a == b or (math.isnan(a) and math.isnan(b))


class Heartbeat(BaseModel):
    """One rank's latest sign of life."""

    model_config = ConfigDict(extra="forbid")
    schema_version: int = 1
    rank: int
    pid: int
    attempt: int
    step: int
    phase: Phase
    time: float
    source: Source = "runtime"


def heartbeat_path(run_dir: Path, rank: int) -> Path:
    return run_dir / HEARTBEATS / f"rank-{rank:05d}.json"


def write_heartbeat(run_dir: Path, beat: Heartbeat) -> None:
    """Replace the rank's heartbeat file atomically (no fsync: liveness, not durability); for one-off writes."""
    path = heartbeat_path(run_dir, beat.rank)
    tmp = path.with_name(f".{path.name}.{beat.pid}")
    tmp.write_text(beat.model_dump_json())
    os.replace(tmp, path)


HEARTBEAT_BYTES = 256  # every in-place beat is padded to this size, so a shorter one never leaves a longer one's tail


class HeartbeatFile:
    """A rank's heartbeat file kept open and rewritten in place: one ``pwrite`` of a fixed-size record.

    A beat of a running rank costs a few microseconds instead of the create, write and
    rename of :func:`write_heartbeat` (hundreds of microseconds of CPU, milliseconds of wall
    time on a busy file system). The record is JSON padded with spaces to
    ``HEARTBEAT_BYTES``; a reader that catches a write half done gets bytes that differ
    from a second read, and :func:`read_heartbeats` skips such a file for that poll.
    """

    def __init__(self, run_dir: Path, rank: int) -> None:
        path = heartbeat_path(run_dir, rank)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        os.ftruncate(self._fd, 0)  # a longer record of an older writer must not trail ours
        self._pid = os.getpid()
        self._size = HEARTBEAT_BYTES  # every write covers the whole file: it only ever grows

    def write(self, beat: Heartbeat) -> None:
        if os.getpid() != self._pid:  # a forked child (a data-loader worker) never beats for its parent
            return
        data = beat.model_dump_json().encode()
        self._size = max(self._size, len(data))
        os.pwrite(self._fd, data.ljust(self._size), 0)

    def close(self) -> None:
        if self._fd >= 0 and os.getpid() == self._pid:
            os.close(self._fd)
        self._fd = -1


def read_heartbeat(path: Path) -> Heartbeat | None:
    """One rank's beat, or None when the file is missing, half written or garbled (read twice: an in-place
    rewrite caught half done reads differently the second time)."""
    try:
        first = path.read_bytes()
        if first != path.read_bytes():
            return None
        return Heartbeat.model_validate_json(first)
    except (OSError, ValueError):
        return None


def read_heartbeats(run_dir: Path) -> dict[int, Heartbeat]:
    beats: dict[int, Heartbeat] = {}
    for path in (run_dir / HEARTBEATS).glob("rank-*.json"):
        beat = read_heartbeat(path)
        if beat is not None:
            beats[beat.rank] = beat
    return beats


def write_fatal(run_dir: Path, rank: int, reason: str, exit_code: int) -> None:
    """A worker's word that a restart cannot help (refused config, anomaly stop, bad precision; exit 1:
    saves failed too often, the disk must be fixed first): the supervisor ends the run with ``exit_code``.
    Appended to this node's file (``fatal.json`` on node 0, ``nodes/node-K/fatal.json`` elsewhere)."""
    path = node_file(run_dir, FATAL)
    path.parent.mkdir(parents=True, exist_ok=True)
    append_jsonl(path, {"rank": rank, "reason": reason, "exit_code": exit_code, "time": time.time()})


def read_fatal(run_dir: Path) -> list[dict[str, Any]]:
    """Every node's fatal records, merged by time (the last is the newest)."""
    return read_merged(run_dir, FATAL)
