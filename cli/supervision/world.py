"""The real world the supervisor watches: torchrun trees, the run directory's records, the clock.

:class:`LocalWorld` implements :class:`ckptrun.cli.supervision.observation.World` for
one node. It builds each attempt's C1 environment in one place, starts the
attempt's process tree, and turns processes, heartbeat files and the tails
of ``metrics.jsonl``/``events.jsonl`` into :class:`Observation` s. Importable
without torch.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Protocol

import psutil

from ckptrun.cli.durations import format_duration
from ckptrun.cli.errors import debug_enabled
from ckptrun.cli.progress import Progress, Status
from ckptrun.cli.supervision.attempt import (NODE_VARIABLE, RUN_ID_VARIABLE, WARM_PIDS, AttemptProcess, torchrun_args,
                                              torchrun_command)
from ckptrun.cli.supervision.fork_fallback import EVENT as WARM_WORKERS_OFF, fallback_line, warm_workers_refused
from ckptrun.cli.supervision.failures import CONSOLE_NAME, FAILURES_NAME, RankFailure, rank_log, read_failures, stderr_tail
from ckptrun.cli.supervision.observation import Observation, RankView, Snapshot
from ckptrun.cli.supervision.policy import STACK_WAIT_S
from ckptrun.cli.supervision.rank_output import PREFIX_TEMPLATE, PREFIX_VARIABLE, RankOutput, selector
from ckptrun.cli.supervision.rundir import RunPaths
from ckptrun.cli.supervision.spec import LaunchSpec
from ckptrun.cli.store_location import store_of
from ckptrun.cli.supervision.snapshot_source import SnapshotSource
from ckptrun.cli.supervision.standby import StandbyKeeper
from ckptrun.cli.supervision.memory_tier import MemoryDir
from ckptrun.runtime import records
from ckptrun.runtime.env import PREFIX, RunEnv

class Estimator(Protocol):
    """The recovery budget's in-launch estimate (the module :mod:`ckptrun.cli.recovery_budget.rto_launch`),
    handed in by the command that launches: the supervision engine never imports the recovery budget."""

    def estimate(self, run_dir: Path, backoff_s: float, budget_s: float | None) -> dict[str, Any]: ...
    def interval_cap(self, run_dir: Path, budget_s: float | None) -> float | None: ...


class JsonlTail:
    """New whole records appended to a JSONL file since the last read (a partial last line waits)."""

    def __init__(self, path: Path, from_end: bool = True) -> None:
        self.path = path
        self.offset = path.stat().st_size if from_end and path.exists() else 0

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as stream:
                stream.seek(self.offset)
                data = stream.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        out = []
        for raw in data[:end].split(b"\n"):
            try:
                record = json.loads(raw) if raw.strip() else None
            except ValueError:
                continue
            if isinstance(record, dict):
                out.append(record)
        return out


class EventTails:
    """New records of every events file of the run: the shared ``events.jsonl`` and, on many nodes, each other
    node's ``nodes/node-K/events.jsonl`` (:func:`ckptrun.runtime.records.events_file`). Global rank 0, which
    writes ``snapshot_saved``, ``restored``, ``stopped``…, may run on any node, so the supervisor reads them all."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.tails = {path: JsonlTail(path) for path in self._files()}

    def _files(self) -> list[Path]:
        return [self.run_dir / records.EVENTS, *sorted(self.run_dir.glob(f"nodes/node-*/{records.EVENTS}"))]

    def read(self) -> list[dict[str, Any]]:
        out = []
        for path in self._files():
            if path not in self.tails:  # created since: every record in it is new
                self.tails[path] = JsonlTail(path, from_end=False)
            out.extend(self.tails[path].read())
        return out


class LocalWorld:
    """One node's attempts, observed through psutil and the run directory."""

    def __init__(self, spec: LaunchSpec, run_id: str, paths: RunPaths, ckpt_dir: Path, target: list[str],
                 progress: Progress, restored_step: int | None = None, estimator: Estimator | None = None) -> None:
        self.spec, self.run_id, self.paths, self.ckpt_dir = spec, run_id, paths, ckpt_dir
        self.source = SnapshotSource(ckpt_dir, store_of(spec, run_id), self.say, self.event, cache=spec.node_cache_dir)
        self.estimator = estimator  # None: no RTO estimate and no auto-save cap (unit tests of the world)
        self.target, self.progress = target, progress
        self.attempt = 0
        self.process: AttemptProcess | None = None
        self.warm = spec.forks_ranks
        self.standby = StandbyKeeper(spec.standby, run_id, paths.logs / "standby.log", self.event, warm=self.warm)
        self.identity: dict[str, str] = {}  # the run id and node of C1: what a standby carries from its start
        self.rank_output: RankOutput | None = None
        self.show_ranks = selector(spec.ranks_output)
        self.cadence_told = False
        self.launched = 0.0
        self.metrics = JsonlTail(paths.root / records.METRICS)
        self.own_losses = JsonlTail(paths.root / records.OWN_LOSSES)
        self.events = EventTails(paths.root)
        self.attempt_log: list[dict[str, Any]] = []
        self.first_step_time: float | None = None
        self.last_metric: dict[str, Any] | None = None
        self.rate_base: dict[str, Any] | None = None
        self.snapshot_step: int | None = restored_step  # the status line names the snapshot a resume restored
        self.new_steps: list[dict[str, Any]] = []  # step records since the last observe()
        self.attempt_snapshot: int | None = None  # newest snapshot this attempt saved
        self.estimates: list[dict[str, Any]] = []  # finished RTO estimates, handed over by observe()
        self.supervisor = psutil.Process()
        self.memory = MemoryDir.open(spec, run_id)  # the memory tier's /dev/shm directory; close() deletes it

    # --- clock ---

    def now(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    # --- launching ---

    def run_env(self, attempt: int, resume_from: Path | None) -> RunEnv:
        """Contract C1 for one attempt: built here and nowhere else."""
        return RunEnv(
            **self.spec.worker_policy(), run_id=self.run_id, run_dir=self.paths.root.resolve(),
            ckpt_dir=self.ckpt_dir.resolve(), attempt=attempt, supervised=True, supervisor_pid=self.supervisor.pid,
            supervisor_start_time=self.supervisor.create_time(), resume_from=resume_from, restart=attempt > 1,
            save_interval_cap_seconds=self._interval_cap(), memory_dir=self.memory.path, debug=debug_enabled(),
        )

    def _interval_cap(self) -> float | None:
        """``--save-every auto`` with ``--rto-budget``: the longest interval that keeps a failure within budget."""
        if self.spec.save_every != "auto" or self.estimator is None:
            return None
        return self.estimator.interval_cap(self.paths.root, self.spec.rto_budget)

    def launch(self, attempt: int, resume_from: Path | None) -> None:
        self.attempt, self.launched = attempt, time.time()
        self.metrics, self.events = JsonlTail(self.metrics.path), EventTails(self.paths.root)
        self.own_losses = JsonlTail(self.own_losses.path)
        self.attempt_log, self.first_step_time, self.last_metric, self.rate_base = [], None, None, None
        self.new_steps, self.attempt_snapshot = [], None
        log_dir = self.paths.attempt_logs(attempt)
        log_dir.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}
        env.update(self.run_env(attempt, resume_from).to_env())
        # console.log gets [rankN]: lines as they are printed (prints reach a file, not a terminal: unbuffered)
        env.update({PREFIX_VARIABLE: PREFIX_TEMPLATE, "PYTHONUNBUFFERED": env.get("PYTHONUNBUFFERED") or "1"})
        if self.warm and warm_workers_refused(self.paths.root):  # forked ranks found CUDA poisoned: spawn from now on
            self.warm = self.standby.warm = False
        warm_pids = log_dir / WARM_PIDS if self.warm else None  # ranks forked from the agent (runtime/worker/warm_start.py)
        command = torchrun_command(log_dir / FAILURES_NAME, torchrun_args(self.spec, log_dir), self.attempt_target(attempt),
                                   warm_pids)
        self.identity = {k: env[k] for k in (RUN_ID_VARIABLE, NODE_VARIABLE) if k in env}
        self._stop_rank_output()
        if self.show_ranks is not None:
            self.rank_output = RankOutput(log_dir / CONSOLE_NAME, self.show_ranks, self.progress.echo)
        self.process = self.standby.start(attempt, command, env, log_dir / CONSOLE_NAME, warm_pids)

    def attempt_target(self, attempt: int) -> list[str]:
        """The script and its arguments for one attempt: ``--restart-args`` join them from the second on."""
        return [*self.target, *self.spec.restart_args] if attempt > 1 else list(self.target)

    # --- observing ---

    def observe(self) -> Observation:
        process = self._process()
        obs = Observation(time=time.time(), agent_exit=process.exit_code(), stop_file=self.paths.stop_file.exists())
        beats = {r: b for r, b in records.read_heartbeats(self.paths.root).items() if b.attempt == self.attempt}
        for rank in process.discover_ranks():
            obs.ranks[rank] = RankView(alive=process.alive(rank), beat=beats.get(rank))
        self._read_tails()
        if self.first_step_time is not None or (self.attempt == 1 and obs.ranks):  # no restart's RTO to slow down
            self.standby.prepare(self.identity)  # the next attempt's agent, warm while this one trains
        obs.steps, self.new_steps = self.new_steps, []
        obs.snapshot_step = self.attempt_snapshot
        obs.rto_estimate = self.estimates.pop(0) if self.estimates else None
        obs.first_step_time = self.first_step_time
        if self.last_metric is not None:
            obs.last_step = int(self.last_metric["step"])
            obs.last_step_time = float(self.last_metric.get("time", obs.time))
        return obs

    def _read_tails(self) -> None:
        for record in self.metrics.read():
            if record.get("attempt") != self.attempt or "step" not in record:
                continue
            if self.first_step_time is None:
                self.first_step_time = float(record.get("time", time.time()))
                self.rate_base = record
            self.last_metric = record
            self.new_steps.append(record)
        for record in self.own_losses.read():  # rank 0's own loss per step (``own``): what the resume check compares
            if record.get("attempt") == self.attempt and "step" in record:
                self.new_steps.append(record)
        for record in self.events.read():
            self.attempt_log.append(record)
            if record.get("event") == "snapshot_saved":
                self.snapshot_step = self.attempt_snapshot = record.get("step")
            elif record.get("event") == "restored" and record.get("attempt") == self.attempt:
                self.snapshot_step = record.get("step")  # what the ranks restored: a memory-tier one may be newer
            elif record.get("event") == WARM_WORKERS_OFF:
                self.say(fallback_line(record))
            elif record.get("event") == "cadence" and not self.cadence_told:
                self.cadence_told = True
                self.say(f"save cadence: a snapshot every {format_duration(record.get('interval_s'))} ({record.get('reason')}; "
                         f"save cost δ {format_duration(record.get('stall_s'))}, MTBF {format_duration(record.get('mtbf_s'))})")

    def late_steps(self) -> list[dict[str, Any]]:
        """Step records read after the last observation (while the attempt ended)."""
        self._read_tails()
        steps, self.new_steps = self.new_steps, []
        return steps

    def attempt_events(self, name: str) -> list[dict[str, Any]]:
        self._read_tails()
        return [r for r in self.attempt_log if r.get("event") == name]

    def failures(self) -> tuple[list[RankFailure], str | None]:
        log_dir = self.paths.attempt_logs(self.attempt)
        self._link_rank_logs()
        failures, agent_error = read_failures(log_dir)
        for failure in failures:
            if failure.rank is not None:
                found = rank_log(log_dir, failure.rank)
                failure.log = str(found) if found else failure.log
                failure.stderr_tail = stderr_tail(found)
        return failures, agent_error

    def fatal_records(self) -> list[dict[str, Any]]:
        return [r for r in records.read_fatal(self.paths.root) if float(r.get("time", 0)) >= self.launched]

    def stop_file_present(self) -> bool:
        return self.paths.stop_file.exists()

    # --- acting ---

    def dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """SIGUSR2 → each rank prints all its threads' stacks to its stderr log; returns what it printed."""
        process = self._process()
        self._link_rank_logs()
        logs = {r: rank_log(self.paths.attempt_logs(self.attempt), r) for r in ranks}
        sizes = {r: _size(p) for r, p in logs.items()}
        process.signal_ranks(ranks, signal.SIGUSR2)
        deadline, stable_since = time.monotonic() + STACK_WAIT_S, None
        last = dict(sizes)
        while time.monotonic() < deadline:
            time.sleep(0.1)
            now = {r: _size(p) for r, p in logs.items()}
            grown = all(now[r] > sizes[r] for r in ranks)
            stable_since = (stable_since or time.monotonic()) if now == last else None
            last = now
            if grown and stable_since and time.monotonic() - stable_since >= 0.2:
                break
        return {r: _read_from(logs[r], sizes[r]) for r in ranks}

    def teardown(self, failed: bool = False) -> float:
        seconds = self._process().teardown(self.spec.grace_period, self.run_id, failed, spare=self.standby.waiting_pids())
        self._link_rank_logs()
        self._stop_rank_output()
        return seconds

    def close(self) -> None:
        """Tear down an attempt still running (the supervisor is leaving on an error of its own)."""
        self.standby.close()
        if self.process is not None and self.process.exit_code() is None:
            self.teardown()
        self._stop_rank_output()
        self.memory.remove()  # memory snapshots live as long as this supervisor, whatever ended it

    def _stop_rank_output(self) -> None:
        """The ranks' last lines reach the terminal before what the supervisor says next."""
        if self.rank_output is not None:
            self.rank_output.stop()
            self.rank_output = None

    def newest_snapshot(self) -> Snapshot | None:
        return self.source.newest()

    def newest_step(self) -> int | None:
        """The newest durable snapshot's step, without downloading it from a store (a stop's report)."""
        return self.source.newest_step()

    def restart_snapshot(self) -> Snapshot | None:
        """What a restart resumes from: the memory tier's newest snapshot when it is newer and usable, else durable.
        With a store, the durable one is downloaded only when memory does not win (its step is in the listing).
        A copy the ranks quarantined as poisoned is gone from its tier (memory, cache); the store skips it too."""
        self.source.refuse_poisoned(self.attempt_events("snapshot_quarantined"))
        if self.memory.path is None or self.source.remote is None:
            return self.memory.choose(self.newest_snapshot(), self.ckpt_dir, self.run_id, self.event, self.say)
        step = self.source.newest_step()
        listed = Snapshot(self.ckpt_dir / f"step {step} on {self.source.remote.where}", step) if step is not None else None
        chosen = self.memory.choose(listed, self.ckpt_dir, self.run_id, self.event, self.say)
        return chosen if chosen is not listed else self.newest_snapshot()

    def quarantine(self, snapshot: Path, status: str, reason: str) -> Path:
        return self.source.quarantine(snapshot, status, reason)

    def abandon_after(self, snapshot: Path | None) -> list[Path]:
        return self.source.abandon_after(snapshot)

    def request_stop(self) -> None:
        self.paths.stop_file.touch()

    def terminate_ranks(self) -> None:
        """SIGTERM to every rank (a plain script's stop: it cannot be asked to save)."""
        process = self._process()
        process.signal_ranks(list(process.discover_ranks()), signal.SIGTERM)

    def request_estimate(self, backoff_s: float) -> None:
        """Estimate the RTO on a thread (it hashes and reads the newest snapshot); observe() hands it over."""
        estimator = self.estimator

        def work() -> None:
            try:
                if estimator is None:
                    raise RuntimeError("no recovery-budget estimator was handed to this world")
                result = estimator.estimate(self.paths.root, backoff_s, self.spec.rto_budget)
            except Exception as exc:  # noqa: BLE001 - an estimate must never take the supervisor down
                result = {"error": getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"}
            self.estimates.append(result)

        threading.Thread(target=work, name="ckptrun-rto-estimate", daemon=True).start()

    def event(self, name: str, **fields: Any) -> None:
        records.log_event(self.paths.root, name, **fields)

    def say(self, line: str) -> None:
        self.progress.say(line)

    def show_progress(self, attempt: int, restarts: int, observation: Observation, recovery: dict[str, Any]) -> None:
        status = Status(attempt=attempt, restarts=restarts, snapshot_step=self.snapshot_step, **recovery)
        metric = self.last_metric
        if metric is not None:
            status.step, status.loss = int(metric["step"]), metric.get("loss")
            status.samples_per_s = _rate(self.rate_base, metric)
        self.progress.show(status)

    # --- helpers ---

    def _process(self) -> AttemptProcess:
        if self.process is None:
            raise RuntimeError("no attempt was launched")
        return self.process

    def _link_rank_logs(self) -> None:
        """``logs/attempt-N/rank-R`` → torchrun's ``<id>/attempt_0/R`` directory, for people."""
        log_dir = self.paths.attempt_logs(self.attempt)
        for rank_dir in log_dir.glob("*/attempt_*/*"):
            link = log_dir / f"rank-{rank_dir.name}"
            if rank_dir.is_dir() and rank_dir.name.isdigit() and not link.exists():
                try:
                    link.symlink_to(rank_dir.relative_to(log_dir))
                except OSError:
                    pass


def _size(path: Path | None) -> int:
    try:
        return path.stat().st_size if path else 0
    except OSError:
        return 0


def _read_from(path: Path | None, offset: int) -> str:
    if path is None:
        return ""
    try:
        with open(path, "rb") as stream:
            stream.seek(offset)
            return stream.read().decode(errors="replace")
    except OSError:
        return ""


def _rate(base: dict[str, Any] | None, latest: dict[str, Any]) -> float | None:
    if not base or "samples_seen" not in base or "samples_seen" not in latest:
        return None
    elapsed = float(latest.get("time", 0)) - float(base.get("time", 0))
    return (latest["samples_seen"] - base["samples_seen"]) / elapsed if elapsed > 0 else None
