"""What ``ckptrun status`` shows, gathered from a run directory into one JSON-ready document.

Everything comes from the records the supervisor and the ranks keep (contract
C3): ``run.json``, ``events.jsonl``, ``metrics.jsonl``, the heartbeat files,
the supervisor's holder file and the snapshot manifests; process liveness
from psutil. Nothing is written and nothing is hashed: the last snapshot gets
a size check only. ``report`` reads the run's state and step budget from here
too. The words on the terminal are :mod:`ckptrun.cli.commands.status_text`'s.
Importable without torch.
"""

from __future__ import annotations

import json
import socket
import statistics
import time
from collections import deque
from pathlib import Path
from typing import Any

import psutil

from ckptrun.cli.errors import CkptrunError
from ckptrun.cli.store_location import local_dir, store_of
from ckptrun.cli.recovery_budget.rto_history import restart_figure
from ckptrun.cli.supervision.policy import Timeouts
from ckptrun.cli.supervision.rundir import RunPaths, holder, node_holders
from ckptrun.cli.supervision.spec import RUN_JSON, LaunchSpec
from ckptrun.runtime import records
from ckptrun.runtime.manifest import Manifest
from ckptrun.runtime.storage.store import LineageError, current_lineage, published
from ckptrun.runtime.storage.remote_store import FsspecStore
from ckptrun.runtime.checkpoint.verify import verify_remote, verify_snapshot

RATE_WINDOW_S = 60.0  # step rates (stragglers, steps/s) are measured over this much recent time
STRAGGLER_RATIO = 0.8  # a rank slower than this share of the median rank's step rate is a straggler
DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0  # when the run has no run.json to say
ENDINGS = {"run_completed": "completed", "completed": "completed", "run_stopped": "stopped", "stopped": "stopped",
           "gave_up": "failed"}
SESSION_STARTS = ("launch", "resume")
STEP_FLAGS = ("--steps", "--max-steps", "--total-steps", "--max_steps", "--total_steps")
STEP_KEYS = ("steps", "max_steps", "total_steps")
RTO_PARTS = {"detect": "detect_s", "teardown": "teardown_s", "verify": "verify_s", "backoff": "backoff_s",
             "restart": "relaunch_to_first_step_s"}  # estimate-rto's names for the restart event's fields


def check_run_dir(run_dir: Path) -> None:
    if not run_dir.is_dir():
        raise CkptrunError(f"{run_dir}: no such run directory", "pass the RUN_DIR that `ckptrun launch` printed")
    if not any((run_dir / name).exists() for name in (RUN_JSON, records.EVENTS, records.HEARTBEATS)):
        raise CkptrunError(f"{run_dir} is not a ckptrun run directory (no {RUN_JSON}, events or heartbeats)",
                           "pass the RUN_DIR that `ckptrun launch` printed (runs/NAME)")


# --- per-rank step rates across looks ---------------------------------------------------


class StepRates:
    """(time, step) samples per rank from successive heartbeat reads, kept for the last 60 s."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self.samples: dict[int, deque[tuple[float, int, int]]] = {}

    def add(self, beats: dict[int, records.Heartbeat]) -> None:
        for rank, beat in beats.items():
            queue = self.samples.setdefault(rank, deque())
            if queue and queue[-1][2] != beat.attempt:
                queue.clear()  # a new attempt starts over
            if not queue or queue[-1][0] != beat.time:
                queue.append((beat.time, beat.step, beat.attempt))
            while queue and queue[-1][0] - queue[0][0] > self.window_s:
                queue.popleft()

    def rate(self, rank: int) -> float | None:
        """Steps per second over the window, None until two different heartbeats were seen."""
        queue = self.samples.get(rank)
        if not queue or len(queue) < 2 or queue[-1][0] <= queue[0][0]:
            return None
        return (queue[-1][1] - queue[0][1]) / (queue[-1][0] - queue[0][0])

    def stragglers(self) -> set[int]:
        rates = {rank: self.rate(rank) for rank in self.samples}
        known = [r for r in rates.values() if r is not None]
        if len(known) < 2:
            return set()
        median = statistics.median(known)
        return {rank for rank, r in rates.items() if r is not None and r < STRAGGLER_RATIO * median}


# --- the document -------------------------------------------------------------------------


def collect(run_dir: Path, rates: StepRates, budget: float | None = None, now: float | None = None) -> dict[str, Any]:
    """Everything ``status`` shows, as one JSON-ready document."""
    now = time.time() if now is None else now
    spec, run_id = read_spec(run_dir)
    events, metrics = records.read_events(run_dir), records.read_metrics(run_dir)
    beats = records.read_heartbeats(run_dir)
    rates.add(beats)
    supervisor = holder(RunPaths(run_dir))
    nodes = node_rows(run_dir)
    if supervisor is None and nodes:
        supervisor = next((n for n in nodes if n["node"] == 0 and n["alive"] is not False), None)
    ranks = rank_rows(beats, rates, timeouts(spec), now)
    current = attempts(events, beats)
    place_ranks(ranks, nodes, run_dir, current["attempt"])
    state = run_state(events, supervisor is not None or any(r["alive"] for r in ranks))
    for row in ranks:
        if current["attempt"] is not None and row["attempt"] < current["attempt"]:
            row["flags"].append(f"from attempt {row['attempt']}")  # its rank has not beaten in this attempt yet
        elif state in ("running", "recovering") and row["alive"] is False and row["phase"] not in ("done", "stopping", "returned"):
            row["flags"].append("dead")
    snapshot, manifest = last_snapshot(ckpt_dir_of(spec, run_dir), now, store_of(spec))
    return {
        "run_dir": str(run_dir), "run_id": run_id, "state": state, "time": now,
        "supervisor_pid": supervisor["pid"] if supervisor else None,
        "nodes": nodes,
        "spares": spare_rows(run_dir),
        **current,
        "progress": progress(metrics, step_budget(spec, manifest), state),
        "ranks": ranks,
        "plain_script": any(e.get("event") == "plain_script" for e in events),
        "snapshot": snapshot,
        "rto": rto(events, budget),
        "tiers_off": tiers_off(events),
    }


def tiers_off(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tiers the run asked for that switched off in its latest attempt (the memory tier, after failed saves)."""
    starts = [e.get("attempt") for e in events if e.get("event") == "attempt_start"]
    latest = starts[-1] if starts else None
    return [{"tier": "memory", "attempt": e.get("attempt"), "step": e.get("step"), "reason": e.get("reason")}
            for e in events if e.get("event") == "memory_tier_off" and e.get("attempt") == latest][:1]


def read_spec(run_dir: Path) -> tuple[LaunchSpec | None, str | None]:
    """run.json's spec and run id; a run without one (plain torchrun) has neither."""
    try:
        data = json.loads((run_dir / RUN_JSON).read_text())
        return LaunchSpec.model_validate(data["spec"]), data.get("run_id")
    except (OSError, ValueError, KeyError, TypeError):
        return None, None


def ckpt_dir_of(spec: LaunchSpec | None, run_dir: Path) -> Path:
    if spec is None:
        return run_dir / "checkpoints"
    return local_dir(spec.store_url, spec.local_cache_dir, spec.ckpt_dir, run_dir)


def timeouts(spec: LaunchSpec | None) -> Timeouts:
    if spec is None:
        return Timeouts(heartbeat=DEFAULT_HEARTBEAT_TIMEOUT_S)
    return Timeouts(heartbeat=spec.heartbeat_timeout, startup=spec.startup_timeout, save=spec.save_timeout)


def run_state(events: list[dict[str, Any]], alive: bool) -> str:
    """running (recovering: between a failure and the next attempt), or how the latest launch/resume ended:
    completed, stopped, failed, or not running (the supervisor left no word)."""
    if alive:
        phases = [e.get("event") for e in events if e.get("event") in ("failure", "attempt_start")]
        return "recovering" if phases and phases[-1] == "failure" else "running"
    state = "not running"
    for event in events:
        name = event.get("event")
        if name in SESSION_STARTS:
            state = "not running"
        elif name in ENDINGS:
            state = ENDINGS[name]
    return state


def attempts(events: list[dict[str, Any]], beats: dict[int, records.Heartbeat]) -> dict[str, Any]:
    """The current attempt, restarts (relaunches after a failure) and failures, over the run's whole life."""
    starts = [e for e in events if e.get("event") == "attempt_start"]
    attempt = int(starts[-1].get("attempt", 1)) if starts else max((b.attempt for b in beats.values()), default=None)
    return {"attempt": attempt,
            "restarts": sum(1 for e in starts if (e.get("restarts") or 0) > 0),
            "failures": sum(1 for e in events if e.get("event") == "failure")}


def rank_rows(beats: dict[int, records.Heartbeat], rates: StepRates, limits: Timeouts, now: float) -> list[dict[str, Any]]:
    stragglers = rates.stragglers()
    rows = []
    for rank, beat in sorted(beats.items()):
        alive = pid_alive(beat.pid, beat.time)
        age = now - beat.time
        allowance = limits.allowance(beat)
        flags = ["stale"] if alive and allowance is not None and age > allowance else []
        if rank in stragglers:
            flags.append("straggler")
        rows.append({"rank": rank, "pid": beat.pid, "alive": alive, "attempt": beat.attempt, "phase": beat.phase,
                     "step": beat.step, "heartbeat_age_s": age, "stale_after_s": allowance,
                     "steps_per_s": rates.rate(rank), "flags": flags})
    return rows


def node_rows(run_dir: Path) -> list[dict[str, Any]]:
    """A many-node run's launchers (none for one node): node rank, pid, host, alive (None: another host)."""
    return [{"node": node, "pid": info.get("pid"), "host": info.get("host"), "alive": info["alive"]}
            for node, info in sorted(node_holders(run_dir).items())]


def spare_rows(run_dir: Path) -> list[dict[str, Any]]:
    """A many-node run's waiting spares (``launch --spare``): spare number, pid, host, alive (None: another host)."""
    from ckptrun.cli.supervision.spares import listed

    rows = []
    for spare in listed(run_dir):
        here = spare.get("host") == socket.gethostname()
        rows.append({"spare": spare.get("spare"), "pid": spare.get("pid"), "host": spare.get("host"),
                     "alive": psutil.pid_exists(int(spare.get("pid") or 0)) if here else None})
    return rows


def place_ranks(ranks: list[dict[str, Any]], nodes: list[dict[str, Any]], run_dir: Path, attempt: int | None) -> None:
    """Each rank's node (``nodes/node-K/ranks.json``, written by that node's launcher per attempt); a rank on
    another host cannot be checked for life here (``alive`` None), only by its heartbeat's age."""
    if not nodes:
        return
    where = {}
    for path in run_dir.glob("nodes/node-*/ranks.json"):
        try:
            placed = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        where.update({int(rank): int(path.parent.name.removeprefix("node-")) for rank in placed.get("ranks", [])})
    hosts = {n["node"]: n["alive"] is not None for n in nodes}
    for row in ranks:
        row["node"] = where.get(row["rank"])
        if row["node"] is not None and not hosts.get(row["node"], True):
            row["alive"] = None


def pid_alive(pid: int, beat_time: float) -> bool:
    """The process that wrote a heartbeat at ``beat_time`` still runs (a newer process with its pid does not count)."""
    try:
        process = psutil.Process(pid)
        return process.create_time() <= beat_time + 1.0 and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def last_snapshot(ckpt_dir: Path, now: float, remote: FsspecStore | None = None) -> tuple[dict[str, Any] | None, Manifest | None]:
    """The newest published snapshot of the current lineage, with a quick size check (no hashing);
    for a store run, the newest committed one of the store's line (sizes from its listing)."""
    if remote is not None:
        return _store_snapshot(remote, now)
    try:
        chain = current_lineage(ckpt_dir)
    except LineageError:
        chain = published(ckpt_dir)
    if not chain:
        return None, None
    entry, manifest = max(chain, key=lambda pair: pair[0].step)
    return _snapshot_facts(entry.path, manifest, now), manifest


def _store_snapshot(remote: FsspecStore, now: float) -> tuple[dict[str, Any] | None, Manifest | None]:
    try:
        prefixes = remote.prefixes()
        line = remote.line(prefixes)
    except Exception as exc:  # noqa: BLE001 - status reports an unreachable store, it does not fail on it
        return {"path": remote.where, "step": None, "verified": False, "check": "listing", "problems": [f"{type(exc).__name__}: {exc}"]}, None
    if not line:
        return None, None
    check = verify_remote(remote, line[-1].name, quick=True, prefixes=prefixes)
    manifest = line[-1].manifest
    return {"path": line[-1].where, "step": manifest.step, "bytes": manifest.total_bytes, "created": manifest.created,
            "age_s": now - manifest.created, "verified": check.ok, "check": "sizes", "problems": check.problems}, manifest


def _snapshot_facts(path: Path, manifest: Manifest, now: float) -> dict[str, Any]:
    check = verify_snapshot(path, quick=True)
    return {"path": str(path), "step": manifest.step, "bytes": manifest.total_bytes, "created": manifest.created,
            "age_s": now - manifest.created, "verified": check.ok, "check": "sizes", "problems": check.problems}


def step_budget(spec: LaunchSpec | None, manifest: Manifest | None) -> int | None:
    """Total optimizer steps: the script's --steps argument, else the config the last snapshot recorded."""
    args = spec.script_args if spec is not None else []
    for index, arg in enumerate(args):
        name, _, value = arg.partition("=")
        if name in STEP_FLAGS:
            value = value or (args[index + 1] if index + 1 < len(args) else "")
            if value.isdigit():
                return int(value)
    config = manifest.config if manifest is not None else {}
    return next((int(config[k]) for k in STEP_KEYS if isinstance(config.get(k), int)), None)


def progress(metrics: list[dict[str, Any]], total: int | None, state: str) -> dict[str, Any]:
    """Step, loss, steps/s over the last minute of the latest attempt, and the ETA while running."""
    steps = [m for m in metrics if isinstance(m.get("step"), int) and isinstance(m.get("time"), (int, float))]
    if not steps:
        return {"step": None, "total_steps": total, "loss": None, "steps_per_s": None, "samples_per_s": None, "eta_s": None}
    last = steps[-1]
    recent = [m for m in steps if m.get("attempt") == last.get("attempt") and last["time"] - m["time"] <= RATE_WINDOW_S]
    span = recent[-1]["time"] - recent[0]["time"]
    rate = (recent[-1]["step"] - recent[0]["step"]) / span if span > 0 else None
    samples = [m["samples_per_s"] for m in recent if isinstance(m.get("samples_per_s"), (int, float))]
    eta = (total - last["step"]) / rate if state == "running" and total and rate else None
    return {"step": last["step"], "total_steps": total, "loss": last.get("loss"), "steps_per_s": rate,
            "samples_per_s": statistics.median(samples) if samples else None, "eta_s": eta}


def rto(events: list[dict[str, Any]], budget: float | None) -> dict[str, Any]:
    """The RTO past restarts measured (medians), and the budget verdict when one was given."""
    restarts = [e for e in events if e.get("event") == "restart"]
    value, count = restart_figure(restarts, "rto_s")
    parts = {name: restart_figure(restarts, key)[0] for name, key in RTO_PARTS.items()}
    return {"rto_s": value, "restarts_measured": count, "components_s": parts, "budget_s": budget,
            "within_budget": None if budget is None or value is None else value <= budget}


