"""What a run's own records say about recovery: past restarts, save cadence and cost, step time.

Reads ``events.jsonl`` and ``metrics.jsonl`` through :mod:`ckptrun.runtime.records`
(their owner) and, for a bare checkpoint directory, the manifests' creation
times. Every function here is pure over plain records, so tests feed it
tables. Importable without torch.

Event fields used (written by the runtime and the supervisor):

* ``restart``: ``detect_s``, ``teardown_s``, ``verify_s``, ``backoff_s``,
  ``relaunch_to_first_step_s``, ``first_step_s``, ``rto_s``, ``lost_steps``;
* ``snapshot_saved``: ``step``, ``stall_s``, ``write_s`` (or ``persist_s`` +
  ``publish_s``), ``total_s``, and ``asynchronous`` (also read as ``async``
  or ``mode: "async"``): true when the training loop waited only for
  ``stall_s`` while the write ran in the background; absent or false, a
  synchronous save, whose whole ``total_s`` stalls training;
* ``restored`` (with ``attempt``), and the segment breaks ``launch``,
  ``resume``, ``attempt_start``, ``failure``; ``completed``/``stopped`` mark
  a final save that is off the cadence;
* metrics: ``attempt``, ``step``, ``time``, ``step_time_s``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Iterable

BREAKS = ("launch", "resume", "attempt_start", "failure", "restored")
ENDINGS = ("completed", "stopped")


def median(values: Iterable[float | None]) -> float | None:
    present = [float(v) for v in values if isinstance(v, (int, float))]
    return statistics.median(present) if present else None


def restart_figure(restarts: list[dict[str, Any]], key: str) -> tuple[float | None, int]:
    """Median of one field over past ``restart`` events, and how many had it."""
    values = [r[key] for r in restarts if isinstance(r.get(key), (int, float))]
    return median(values), len(values)


# --- saves: interval τ, stall δ, background persist w ------------------------------


@dataclass(frozen=True)
class SaveFacts:
    """The save cadence and cost as the records show them (None: the records do not say)."""

    interval_s: float | None  # τ: training time between saves
    interval_steps: float | None
    stall_s: float | None  # δ: what a save costs the training loop
    persist_s: float  # w: background persist time (0 for synchronous saves)
    asynchronous: bool
    saves: int
    intervals: int

    @property
    def mode(self) -> str:
        return "async" if self.asynchronous else "sync"


def _is_async(event: dict[str, Any]) -> bool:
    return bool(event.get("async") or event.get("asynchronous")) or event.get("mode") == "async"


def background_s(event: dict[str, Any]) -> float | None:
    """w of one asynchronous save: its persist and publish, which ran while training went on."""
    whole = _number(event.get("write_s"))
    if whole is None and _number(event.get("persist_s")) is not None:
        whole = float(event["persist_s"]) + (_number(event.get("publish_s")) or 0.0)
    return whole


def save_stall(event: dict[str, Any]) -> float | None:
    """δ of one save: the stall alone when the persist ran in the background, else the whole save."""
    if _is_async(event):
        return _number(event.get("stall_s"))
    whole = _number(event.get("total_s"))
    if whole is None and _number(event.get("stall_s")) is not None:
        whole = float(event["stall_s"]) + (_number(event.get("write_s")) or 0.0)
    return whole


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


def save_segments(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """``snapshot_saved`` events grouped into runs of consecutive saves within one attempt."""
    segments: list[list[dict[str, Any]]] = [[]]
    for event in events:
        kind = event.get("event")
        if kind in BREAKS and segments[-1]:
            segments.append([])
        elif kind == "snapshot_saved" and _number(event.get("time")) is not None and "step" in event:
            segments[-1].append(event)
    return [segment for segment in segments if segment]


def save_facts(events: list[dict[str, Any]]) -> SaveFacts:
    """τ, δ and w from ``snapshot_saved`` events.

    Between two consecutive saves of one attempt the wall time is τ plus the
    later save's δ (events are logged when a save ends). A final save that
    ``finish()`` or a stop adds off the cadence makes a short interval and is
    left out.
    """
    saves = [e for e in events if e.get("event") == "snapshot_saved"]
    endings = {e.get("step") for e in events if e.get("event") in ENDINGS}
    pairs = [(a, b) for segment in save_segments(events) for a, b in zip(segment, segment[1:])]
    typical_steps = median(b["step"] - a["step"] for a, b in pairs)
    kept = [(a, b) for a, b in pairs
            if not (b["step"] in endings and typical_steps is not None and b["step"] - a["step"] < typical_steps)]
    intervals = [float(b["time"]) - float(a["time"]) - (save_stall(b) or 0.0) for a, b in kept]
    asynchronous = bool(saves) and all(_is_async(e) for e in saves)
    return SaveFacts(
        interval_s=median(max(0.0, t) for t in intervals),
        interval_steps=median(b["step"] - a["step"] for a, b in kept),
        stall_s=median(save_stall(e) for e in saves),
        persist_s=(median(background_s(e) for e in saves) or 0.0) if asynchronous else 0.0,
        asynchronous=asynchronous,
        saves=len(saves),
        intervals=len(kept),
    )


def manifest_cadence(created: list[tuple[int, float]]) -> tuple[float | None, float | None]:
    """(seconds, steps) between consecutive snapshots from (step, created time) pairs, oldest first.

    For a bare checkpoint directory: the seconds include each save's own cost.
    """
    ordered = sorted(created)
    pairs = list(zip(ordered, ordered[1:]))
    return median(b[1] - a[1] for a, b in pairs), median(b[0] - a[0] for a, b in pairs)


# --- steps --------------------------------------------------------------------------


def by_attempt(metrics: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    table: dict[int, list[dict[str, Any]]] = {}
    for record in metrics:
        if "step" in record:
            table.setdefault(int(record.get("attempt", 1)), []).append(record)
    return table


def step_time(metrics: list[dict[str, Any]]) -> float | None:
    """Median seconds per optimizer step, leaving out each attempt's first step (start-up, restore)."""
    values: list[float] = []
    for records in by_attempt(metrics).values():
        for previous, record in zip(records, records[1:]):
            elapsed = _number(record.get("step_time_s"))
            if elapsed is None and _number(record.get("time")) is not None and _number(previous.get("time")) is not None:
                elapsed = float(record["time"]) - float(previous["time"])
            if elapsed is not None:
                values.append(elapsed)
    return median(values)


def restored_attempts(events: list[dict[str, Any]]) -> dict[int, float]:
    """{attempt: time of its ``restored`` event} (probe restores are not attempts)."""
    return {int(e["attempt"]): float(e["time"]) for e in events
            if e.get("event") == "restored" and "attempt" in e and _number(e.get("time")) is not None}


def first_step_after_restore(events: list[dict[str, Any]], metrics: list[dict[str, Any]]) -> tuple[float | None, int]:
    """Seconds from a finished restore to the end of the first step after it, and how many attempts show it."""
    restored = restored_attempts(events)
    values = []
    for attempt, records in by_attempt(metrics).items():
        if attempt in restored and _number(records[0].get("time")) is not None:
            values.append(float(records[0]["time"]) - restored[attempt])
    return median(v for v in values if v >= 0), len(values)


def setup_and_first_step(events: list[dict[str, Any]], metrics: list[dict[str, Any]]) -> tuple[float | None, int]:
    """From ``init()`` to the end of the first step, in attempts that restored nothing (the script's own set-up)."""
    restored = restored_attempts(events)
    values = [records[0].get("step_time_s") for attempt, records in by_attempt(metrics).items() if attempt not in restored]
    present = [v for v in values if isinstance(v, (int, float))]
    return median(present), len(present)


def launch_to_first_step(events: list[dict[str, Any]], metrics: list[dict[str, Any]]) -> tuple[float | None, int]:
    """From ``attempt_start`` to the end of the first step, in attempts that restored nothing: a measured
    relaunch without the restore (process start, imports, process group, the script's set-up, one step)."""
    restored = restored_attempts(events)
    started = {int(e["attempt"]): float(e["time"]) for e in events
               if e.get("event") == "attempt_start" and "attempt" in e and _number(e.get("time")) is not None}
    values = [float(records[0]["time"]) - started[attempt] for attempt, records in by_attempt(metrics).items()
              if attempt in started and attempt not in restored and _number(records[0].get("time")) is not None]
    return median(v for v in values if v >= 0), len(values)


def forked_to_process_group(events: list[dict[str, Any]]) -> tuple[float | None, int]:
    """Seconds from a forked (warm) rank's start to its process group, in attempts that started from nothing
    (the ``started`` event's marks; only a forked rank notes its start): the part of a warm standby's hand-over
    that the first attempt already ran."""
    values = [marks["process_group"] - marks["process"] for e in events if e.get("event") == "started"
              and isinstance(marks := e.get("startup") or {}, dict)
              and _number(marks.get("process")) is not None and _number(marks.get("process_group")) is not None]
    return median(v for v in values if v >= 0), len(values)


def device(events: list[dict[str, Any]]) -> str | None:
    """The device the ranks trained on (``cpu``, ``cuda``), from the runtime's ``precision`` event."""
    said = [e.get("device") for e in events if e.get("event") == "precision" and isinstance(e.get("device"), str)]
    return said[-1] if said else None
