"""What ``launch`` and ``resume`` share: prepare the run directory, hold its lock, supervise, report.

``start_run`` creates a new run (refusing a run dir or checkpoint dir that is
already used), ``resume_run`` continues one from a verified snapshot, and both
end in :func:`supervise_run`, which owns the signal handlers, the stop file's
lifetime and the final report. Importable without torch.
"""

from __future__ import annotations

import json
import signal
import sys
import time
import uuid
from pathlib import Path
from types import FrameType
from typing import Any

from ckptrun.cli import store_location
from ckptrun.cli.durations import format_duration
from ckptrun.cli.errors import EXIT_OK, EXIT_STOPPED, EXIT_UNRECOVERABLE, CkptrunError
from ckptrun.cli.progress import Progress
from ckptrun.cli.supervision.attempt import default_job
from ckptrun.cli.supervision.job import Job, OneNode
from ckptrun.cli.supervision.job_store import JobStore
from ckptrun.cli.supervision.node_agent import NodeJob
from ckptrun.cli.supervision.node_env import NodeSettings
from ckptrun.cli.supervision.node_world import NodeWorld
from ckptrun.cli.supervision.observation import Outcome, Snapshot, StopControl
from ckptrun.cli.supervision.policy import RestartPolicy, Timeouts
from ckptrun.cli.supervision.recovery import RecoveryOptions
from ckptrun.cli.supervision.rundir import RUNS_ROOT, RunLock, RunPaths, default_name, holder, unique_run_dir
from ckptrun.cli.supervision import script_args
from ckptrun.cli.supervision.spec import RUN_JSON, LaunchSpec, RunRecord, build_spec, read_run_record, write_run_record
from ckptrun.cli.supervision.standby import StandbyKeeper
from ckptrun.cli.supervision.supervisor import Supervisor
from ckptrun.cli.supervision.world import Estimator, LocalWorld
from ckptrun.runtime import records
from ckptrun.runtime.env import NOT_IMPLEMENTED
from ckptrun.runtime.manifest import ManifestError, read_manifest
from ckptrun.runtime.storage.store import fork, list_entries, snapshot_name
from ckptrun.runtime.checkpoint.verify import newest_verified, verify_snapshot


def ckpt_dir_of(spec: LaunchSpec, run_dir: Path) -> Path:
    """The local snapshot dir: --ckpt-dir, or a store run's local copies (--local-cache, else RUN_DIR/staging)."""
    return store_location.local_dir(spec.store_url, spec.local_cache_dir, spec.ckpt_dir, run_dir)


# --- launch ---------------------------------------------------------------------


def start_run(spec: LaunchSpec, argv: list[str], as_json: bool = False, *, estimator: Estimator) -> int:
    """``ckptrun launch``: a new run directory, then supervision from attempt 1 (``estimator``: the recovery
    budget's in-launch RTO estimate, :mod:`ckptrun.cli.recovery_budget.rto_launch`)."""
    if spec.nnodes.split(":")[-1] != "1":  # many nodes go through many_nodes.start_nodes, one launcher per node
        raise CkptrunError(f"--nnodes {spec.nnodes}: this command runs on one node",
                           "run `ckptrun launch --nnodes N --node-rank K ...` on every node")
    if spec.precision in NOT_IMPLEMENTED:  # refused before a run dir or a rank exists (torch is not imported)
        what, hint = NOT_IMPLEMENTED[spec.precision]
        raise CkptrunError(f"--precision {spec.precision}: {what}", hint)
    if spec.script is not None:
        if not spec.script.is_file():
            raise CkptrunError(f"training script {spec.script} does not exist", "check the path (or omit SCRIPT to run the embedded default job)")
        spec.script = spec.script.resolve()
    name = spec.name or default_name(spec.script)
    run_dir = spec.run_dir or (RUNS_ROOT / name if spec.name else unique_run_dir(RUNS_ROOT, name))
    paths, ckpt_dir = RunPaths(run_dir), ckpt_dir_of(spec, run_dir)
    store_location.probe_local_dir(run_dir, "--run-dir")
    store_location.probe_local_dir(ckpt_dir, "--ckpt-dir" if spec.store_url is None else "the local snapshot dir")
    if holder(paths) is None:  # refuse before creating anything (a held run dir: the lock names its holder)
        _refuse_used(paths, ckpt_dir)
        _refuse_used_store(spec)
    with RunLock(paths) as lock:
        _refuse_used(paths, ckpt_dir)  # again under the lock: another launcher may have just written there
        spec.run_dir, spec.ckpt_dir = run_dir.resolve(), ckpt_dir.resolve()
        record = RunRecord(run_id=f"{name}-{uuid.uuid4().hex[:6]}", argv=argv, spec=spec)
        write_run_record(run_dir, record)
        records.log_event(run_dir, "launch", run_id=record.run_id, argv=record.argv, spec=spec.model_dump(mode="json"))
        _took_over(lock)
        return supervise_run(record, paths, first_attempt=1, resume=None, as_json=as_json, estimator=estimator)


def _refuse_used(paths: RunPaths, ckpt_dir: Path) -> None:
    """A run dir that holds a run, or a checkpoint dir that holds snapshots, belongs to a run: resume that one."""
    if paths.run_json.exists():
        raise CkptrunError(f"{paths.root} already holds a run", f"continue it with `ckptrun resume --latest --run-dir "
                           f"{paths.root}`, or start a new run with another --name")
    if any(e.kind in ("published", "abandoned") for e in list_entries(ckpt_dir)):
        owner = _owner(ckpt_dir)
        which = f"{owner}`" if owner else "RUN_DIR` of the run that wrote them"
        raise CkptrunError(f"checkpoint directory {ckpt_dir} already holds snapshots",
                           f"continue it with `ckptrun resume --latest --run-dir {which}, or pass an empty --ckpt-dir "
                           "for a new run")


def _refuse_used_store(spec: LaunchSpec) -> None:
    """An object-store location that holds committed snapshots belongs to a run, as a local dir does."""
    remote = store_location.store_of(spec)
    if remote is None:
        return
    try:
        held = remote.published()
    except Exception as exc:  # noqa: BLE001 - unreachable, no credentials, no bucket: refused before anything runs
        raise store_location.cannot_list(remote, exc) from None
    if held:
        raise CkptrunError(f"{remote.where} already holds snapshots",
                           "continue that run with `ckptrun resume --latest --run-dir RUN_DIR`, or pass an empty prefix")
    store_location.probe_writable(remote)


def _owner(ckpt_dir: Path) -> Path | None:
    """The run directory whose run.json names ``ckpt_dir`` (its parent, or a run under runs/), if any."""
    for candidate in [ckpt_dir.parent, *sorted(p.parent for p in RUNS_ROOT.glob(f"*/{RUN_JSON}"))]:
        try:
            spec = read_run_record(candidate).spec
        except CkptrunError:
            continue
        if ckpt_dir_of(spec, candidate).resolve() == ckpt_dir.resolve():
            return candidate
    return None


def _took_over(lock: RunLock) -> None:
    if lock.took_over:
        print(f"ckptrun: note: took over the lock of supervisor pid {lock.took_over.get('pid')}, which is gone",
              file=sys.stderr)


# --- resume ---------------------------------------------------------------------


def resume_run(run_dir: Path, source: str | None, overrides: dict[str, Any], argv: list[str], as_json: bool = False, *,
               estimator: Estimator) -> int:
    """``ckptrun resume``: the run's own spec, from its newest verified snapshot or ``source``."""
    paths = RunPaths(run_dir)
    record = read_run_record(run_dir)
    with RunLock(paths) as lock:
        completed = _completed(run_dir)
        if completed is not None and source is None and overrides.get("script_args") is None:
            outcome = Outcome(EXIT_OK, f"run {record.run_id} already completed (step {completed.get('step')}): "
                              "nothing to resume, nothing started",
                              f"`ckptrun resume --from STEP --run-dir {run_dir}` trains again from an older snapshot")
            return _report(outcome, record, paths, Progress(), as_json)
        given = {key: value for key, value in overrides.items() if value is not None}
        record.spec = build_spec({**record.spec.model_dump(), **given})  # a bad combination: one line, exit 2
        print(f"ckptrun: resuming {script_args.command_line(str(record.spec.script) if record.spec.script else None, record.spec.script_args)}"
              + (f" (on restarts: + {' '.join(record.spec.restart_args)})" if record.spec.restart_args else ""),
              file=sys.stderr)
        ckpt_dir = ckpt_dir_of(record.spec, run_dir)
        if source and record.spec.store_url:
            raise CkptrunError("resume --from is not supported on an object store yet", "use --latest")
        snapshot = _from_source(ckpt_dir, source) if source else resume_snapshot(ckpt_dir, record, run_dir)
        _refuse_unasked_reshard(record.spec, snapshot)
        write_run_record(run_dir, record)
        first = next_attempt(run_dir)
        records.log_event(run_dir, "resume", attempt=first, snapshot=str(snapshot.path) if snapshot else None,
                          snapshot_step=snapshot.step if snapshot else None,
                          argv=store_location.redact_argv(argv), forked=bool(source), script_args=overrides.get("script_args"))
        _took_over(lock)
        return supervise_run(record, paths, first_attempt=first, resume=snapshot, as_json=as_json, estimator=estimator)


def next_attempt(run_dir: Path) -> int:
    """A resume's first attempt number: one above every attempt the run directory records."""
    return 1 + max((int(e.get("attempt", 0)) for e in records.read_events(run_dir, "attempt_start")), default=0)


def _completed(run_dir: Path) -> dict[str, Any] | None:
    """The ``run_completed`` event when the run's last attempt completed it (a later resume reopens it)."""
    ends = [e for e in records.read_events(run_dir) if e.get("event") in ("run_completed", "attempt_start")]
    return ends[-1] if ends and ends[-1]["event"] == "run_completed" else None


def _refuse_unasked_reshard(spec: LaunchSpec, snapshot: Snapshot | None) -> None:
    """A resume at another world size than the snapshot's must be asked for: refused before any rank starts."""
    if snapshot is None or spec.allow_reshard or spec.world_size is None:
        return
    saved = read_manifest(snapshot.path).world_size
    if saved != spec.world_size:
        raise CkptrunError(f"snapshot step {snapshot.step} was written by {saved} ranks but this resume runs "
                           f"{spec.world_size}",
                           f"pass --allow-reshard to resume on {spec.world_size} ranks (tensors and the data position "
                           f"reshard, per-rank RNG is reseeded: not bitwise exact), or --nproc-per-node {saved}",
                           EXIT_UNRECOVERABLE)


def resume_snapshot(ckpt_dir: Path, record: RunRecord, run_dir: Path) -> Snapshot | None:
    """The snapshot ``resume --latest`` continues from, on one node or many: None for a script that resumes
    from its own files (a plain or framework script: ckptrun holds no snapshot of it), else the newest
    verified one (exit 2 when there is none)."""
    if records.read_events(run_dir, "plain_script") or records.read_events(run_dir, "framework_script"):
        return None
    return _newest(ckpt_dir, record.spec, run_dir, record.run_id)


def _newest(ckpt_dir: Path, spec: LaunchSpec | None = None, run_dir: Path | None = None,
            run_id: str | None = None) -> Snapshot:
    remote = store_location.store_of(spec, run_id)  # this run's snapshots only
    if remote is not None:  # the store's newest committed snapshot, as the supervisor picks it (verified, local copy)
        started = time.monotonic()
        choice = store_location.fetch_newest(remote, ckpt_dir, lambda line: print(f"ckptrun: {line}", file=sys.stderr))
        if run_dir is not None:
            records.log_event(run_dir, "restore_source", **choice.event_fields())
        return Snapshot(choice.path, choice.step, time.monotonic() - started)
    started = time.monotonic()
    report = newest_verified(ckpt_dir, log=lambda line: print(f"ckptrun: {line}", file=sys.stderr), at_load=True)
    if report is None:
        raise CkptrunError(f"no verified snapshot in {ckpt_dir}",
                           "there is nothing to resume from: launch the run again (`ckptrun launch ...` with a new --name)")
    return Snapshot(report.path, report.step, time.monotonic() - started)


def _from_source(ckpt_dir: Path, source: str) -> Snapshot:
    """``--from STEP_OR_PATH``: verify that snapshot and fork the lineage there (unless it is the newest)."""
    path = ckpt_dir / snapshot_name(int(source)) if source.isdigit() else Path(source)
    started = time.monotonic()
    report = verify_snapshot(path)
    if not report.ok:
        problem = "; ".join(report.problems[:2]) or report.status
        raise CkptrunError(f"snapshot {path} cannot be resumed from: {problem}",
                           "pick another with --from (see `ckptrun verify CKPT_DIR`), or use --latest")
    newest = newest_verified(ckpt_dir)
    if newest is None or newest.path.resolve() != path.resolve():
        lineage = fork(ckpt_dir, path)
        print(f"ckptrun: forked a new lineage {lineage.current} at {path.name}; newer snapshots are kept under "
              f"{ckpt_dir / 'abandoned'}", file=sys.stderr)
    try:
        step = read_manifest(path).step
    except ManifestError as exc:
        raise CkptrunError(f"snapshot {path}: {exc}", "pick another with --from") from None
    return Snapshot(path, step, time.monotonic() - started)


# --- supervision ------------------------------------------------------------------


def supervise_run(record: RunRecord, paths: RunPaths, first_attempt: int, resume: Snapshot | None,
                  as_json: bool = False, *, estimator: Estimator, settings: NodeSettings | None = None,
                  store: JobStore | None = None, standby: StandbyKeeper | None = None) -> int:
    """Run the supervisor with signal handlers installed; report its outcome; clean the stop channel.

    One epilogue for one node and for many: with ``settings`` and ``store`` (the job's store) this launcher
    is one node of a multi-node job, and only the leader owns the shared stop file. ``standby``: a promoted
    spare's, warm since it joined, for the first attempt."""
    spec = record.spec
    progress = Progress(out=sys.stderr if as_json else sys.stdout)  # stdout holds only the JSON document then
    world = _world(record, paths, progress, resume, estimator, settings, store)
    if standby is not None:
        world.standby.take_over(standby)
    stop = StopControl(stop_at=(time.time() + max(0.0, spec.time_limit - spec.grace_period)) if spec.time_limit else None)
    policy = RestartPolicy(spec.max_restarts, spec.max_stalled_restarts, spec.restart_backoff, spec.restart_backoff_cap)
    timeouts = Timeouts(spec.heartbeat_timeout, spec.startup_timeout, spec.save_timeout, spec.grace_period)
    checks = RecoveryOptions(spec.deterministic, spec.require_exact_resume, spec.rto_budget, spec.strict_budget)
    job: Job = NodeJob(world, timeouts, stop, spec.node_join_timeout) if isinstance(world, NodeWorld) else OneNode()
    supervisor = Supervisor(world, policy, timeouts, stop, first_attempt, resume, checks, faults=spec.inject_fault, job=job)
    supervisor.plain_seen = bool(records.read_events(paths.root, "plain_script"))  # known from an earlier attempt
    leads = settings is None or settings.leader  # the stop file is the run's: its leader's to clear
    if leads:
        paths.stop_file.unlink(missing_ok=True)
    role = "" if settings is None else " as leader" if settings.leader else \
        f" as node {settings.node_rank} of {settings.max_nodes}"
    progress.say(f"run {record.run_id} in {paths.root}{role} (logs: {paths.logs})")
    progress.say(snapshot_line(spec))
    with _stop_signals(stop, spec.stop_signal):
        try:
            outcome = supervisor.supervise()
        finally:
            world.close()  # no orphans, even when the supervisor itself fails
            if leads:
                paths.stop_file.unlink(missing_ok=True)
            progress.close()
    return _report(outcome, record, paths, progress, as_json)


def _world(record: RunRecord, paths: RunPaths, progress: Progress, resume: Snapshot | None, estimator: Estimator,
           settings: NodeSettings | None, store: JobStore | None) -> LocalWorld:
    """This node's world: alone, or one node of a job whose store is ``store``."""
    spec = record.spec
    target = [str(spec.script or default_job()), *spec.script_args]
    common: dict[str, Any] = {"restored_step": resume.step if resume else None, "estimator": estimator}
    args = (spec, record.run_id, paths, ckpt_dir_of(spec, paths.root), target, progress)
    if settings is None or store is None:
        return LocalWorld(*args, **common)
    node_timeout = max(5.0, min(spec.heartbeat_timeout, 30.0))
    return NodeWorld(*args, **common, settings=settings, job=store, node_timeout=node_timeout)


def snapshot_line(spec: LaunchSpec) -> str:
    """The start-up line on snapshots: the cadence, or, for a script whose own code never imports ckptrun.runtime
    (read from its code, as the bootstrap reads it), that ckptrun saves nothing for it unless a module it imports
    does (only the ranks can tell: the supervisor's "this script does not use ckptrun.runtime" note follows)."""
    from ckptrun.runtime.worker.bootstrap import names_runtime

    try:
        plain = spec.script is not None and not names_runtime(compile(spec.script.read_bytes(), str(spec.script), "exec"))
    except (OSError, SyntaxError, ValueError):
        plain = False  # the first attempt says what is wrong with it
    if plain:
        return ("snapshots: none by ckptrun, unless a module the script imports uses ckptrun.runtime (the script "
                "itself does not import it; a restart relaunches the script, which resumes only if it loads its own "
                "checkpoint: its step count then says whether it did)")
    return f"snapshots: {cadence(spec)}"


def cadence(spec: LaunchSpec) -> str:
    """When snapshots are saved, in words (printed at launch: the default, auto, saves without being asked)."""
    if spec.save_every == "auto":
        return (f"auto: a snapshot after the first step, then every Daly(save cost, MTBF {format_duration(spec.mtbf)}) "
                "(--save-every-steps N or --save-every-seconds T choose another)")
    every = [f"{spec.save_every_steps} steps" if spec.save_every_steps else None,
             format_duration(spec.save_every_seconds) if spec.save_every_seconds else None]
    return "every " + " or ".join(part for part in every if part)


def _report(outcome: Outcome, record: RunRecord, paths: RunPaths, progress: Progress, as_json: bool) -> int:
    if as_json:
        print(json.dumps({"run_id": record.run_id, "run_dir": str(paths.root), "exit_code": outcome.code,
                          "message": outcome.message, "hint": outcome.hint, "attempts": outcome.attempts,
                          "restarts": outcome.restarts}))
    if outcome.code in (EXIT_OK, EXIT_STOPPED):
        progress.say(outcome.message)
        if outcome.hint:
            progress.say(outcome.hint.replace("--latest", f"--latest --run-dir {paths.root}"))
        return outcome.code
    raise CkptrunError(outcome.message, outcome.hint, outcome.code)


class _stop_signals:
    """SIGINT, SIGTERM and the configured stop signal ask for a stop; a second one forces it."""

    def __init__(self, stop: StopControl, extra: str | None) -> None:
        self.stop = stop
        self.signals = [signal.SIGINT, signal.SIGTERM] + ([signal.Signals[extra]] if extra else [])
        self.previous: dict[signal.Signals, Any] = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.stop.signals += 1
        self.stop.signal_name = signal.Signals(signum).name

    def __enter__(self) -> "_stop_signals":
        for sig in self.signals:
            self.previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

