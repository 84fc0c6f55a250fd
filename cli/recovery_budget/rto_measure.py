"""Measurements ``estimate-rto`` makes now, on this machine, on the snapshot it would restore.

* **verify** — the supervisor's one check before a relaunch, timed on the
  snapshot itself. A schema-2 snapshot is hashed whole there (whole when it is
  small, else a sample of its largest files, extrapolated), saying how much of
  it sat in the page cache; a schema-3 one (chunk digests) gets manifest and
  sizes only, because each rank hashes the bytes it loads.
* **hash rate** — for that verified-as-read restore: one hashing thread's
  bytes/s while as many threads hash at once as the restoring ranks run.
* **read bandwidth** — the same files read again, as restoring ranks read
  them right after the supervisor verified them (so: page-cached, and said so).
* **no-op attempt** — no-op ranks started the way the supervisor starts a
  restart of this run (a warm standby agent handed the attempt, ranks forked
  past their imports — or cold: a fresh agent spawning new interpreters, as
  the run's options say), to process-group init, then torn down with the
  supervisor's own teardown (:mod:`ckptrun.cli.recovery_budget.rto_relaunch`).
* **probes** — the run's own script restoring the newest snapshot and
  stopping there (``exit_after_restore``), relaunched on that same path, or, for a bare checkpoint
  directory, N processes loading it with the runtime's loader and no user code.

torch runs only in child processes (:mod:`ckptrun.cli.recovery_budget.rto_probe`, the user's
script). Importable without torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptrun.cli.errors import EXIT_NO, CkptrunError
from ckptrun.cli.recovery_budget import rto_relaunch as relaunch
from ckptrun.cli.supervision.attempt import default_job
from ckptrun.cli.supervision.spec import LaunchSpec
from ckptrun.runtime import records
from ckptrun.runtime.env import PREFIX, RunEnv, variable
from ckptrun.runtime.hashing import CHUNK, new_hasher
from ckptrun.runtime.manifest import Manifest
from ckptrun.runtime.checkpoint.verify import default_threads, verify_snapshot

SAMPLE_BYTES = 256 << 20  # verify a snapshot whole up to this size, else a sample this big
HASH_SAMPLE_BYTES = 64 << 20  # hash this much to measure the hash rate of a verified-as-read restore


# --- page cache -----------------------------------------------------------------------


def _resident(path: Path, length: int) -> tuple[int, int] | None:
    """(resident pages, pages) of the first ``length`` bytes of ``path``, by mincore(2); None if unavailable."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                              ctypes.c_int, ctypes.c_int, ctypes.c_long]
    page = os.sysconf("SC_PAGE_SIZE")
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, length, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
    finally:
        os.close(fd)
    if address in (None, ctypes.c_void_p(-1).value):
        return None
    pages = (length + page - 1) // page
    vector = (ctypes.c_ubyte * pages)()
    try:
        if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(length), vector) != 0:
            return None
    finally:
        libc.munmap(ctypes.c_void_p(address), ctypes.c_size_t(length))
    return pages - bytes(vector).count(0), pages


def resident_fraction(parts: list[tuple[Path, int]]) -> float | None:
    """Share of these byte ranges held in the page cache now (None where mincore is unavailable)."""
    held = total = 0
    try:
        for path, length in parts:
            if length <= 0:
                continue
            found = _resident(path, length)
            if found is None:
                return None
            held, total = held + found[0], total + found[1]
    except (OSError, AttributeError):
        return None
    return held / total if total else None


def cache_words(fraction: float | None) -> str:
    if fraction is None:
        return "page-cache state unknown"
    if fraction >= 0.9:
        return f"page-cached ({fraction:.0%} resident)"
    if fraction <= 0.1:
        return f"not page-cached ({fraction:.0%} resident)"
    return f"partly page-cached ({fraction:.0%} resident)"


# --- verify and read ------------------------------------------------------------------


@dataclass(frozen=True)
class VerifyTiming:
    seconds: float
    bytes: int
    files: int
    sampled_bytes: int
    resident: float | None
    status: str | None  # the verdict when verified whole; None when sampled
    threads: int
    deferred: bool = False  # manifest and sizes only: the digests are checked as the ranks load

    @property
    def throughput(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else float("inf")


def _hash_prefix(path: Path, length: int, algorithm: str) -> tuple[int, float]:
    """Hash the first ``length`` bytes; (bytes, seconds) for this one thread."""
    started, hasher, done = time.monotonic(), new_hasher(algorithm), 0
    with open(path, "rb", buffering=0) as stream:
        buffer = bytearray(CHUNK)
        while done < length:
            count = stream.readinto(memoryview(buffer)[: min(CHUNK, length - done)])
            if not count:
                break
            hasher.update(memoryview(buffer)[:count])
            done += count
    return done, time.monotonic() - started


def _sample(snapshot: Path, manifest: Manifest, budget: int, threads: int) -> list[tuple[Path, int, str]]:
    """The largest files, at most one per thread, each cut to its share of the sample."""
    largest = sorted(manifest.files, key=lambda e: e.size, reverse=True)[: max(1, threads)]
    share = max(CHUNK, budget // len(largest))
    return [(snapshot / e.path, min(e.size, share), e.algorithm) for e in largest]


def time_verify(snapshot: Path, manifest: Manifest, sample_bytes: int = SAMPLE_BYTES,
                threads: int | None = None) -> VerifyTiming:
    """Time verifying ``snapshot`` as the supervisor does (threads over files).

    Up to ``sample_bytes`` it is verified whole, so the figure is the real
    verification and its verdict comes with it. A larger snapshot is sampled:
    its largest files hashed in parallel, and the estimate is the longer of
    "the largest file at one thread's rate" and "all bytes at the pool's rate".
    """
    threads = threads or default_threads()
    total = manifest.total_bytes
    if total <= sample_bytes:
        resident = resident_fraction([(snapshot / e.path, e.size) for e in manifest.files])
        started = time.monotonic()
        report = verify_snapshot(snapshot)
        return VerifyTiming(time.monotonic() - started, total, len(manifest.files), total, resident, report.status, threads)
    sample = _sample(snapshot, manifest, sample_bytes, threads)
    resident = resident_fraction([(path, length) for path, length, _ in sample])
    started = time.monotonic()
    with ThreadPoolExecutor(len(sample)) as pool:
        results = list(pool.map(lambda item: _hash_prefix(*item), sample))
    wall = time.monotonic() - started
    hashed = sum(done for done, _ in results)
    one_thread = min(done / seconds for done, seconds in results if seconds > 0)
    largest = max(e.size for e in manifest.files)
    seconds = max(largest / one_thread, total / (hashed / wall)) if wall > 0 else 0.0
    return VerifyTiming(seconds, total, len(manifest.files), hashed, resident, None, threads)


def time_load_check(snapshot: Path, manifest: Manifest) -> VerifyTiming:
    """Time the supervisor's check before relaunching from a chunked (schema 3) snapshot: manifest and
    sizes only (``verify_snapshot(at_load=True)``, what it runs), no byte hashed."""
    started = time.monotonic()
    report = verify_snapshot(snapshot, at_load=True)
    return VerifyTiming(time.monotonic() - started, manifest.total_bytes, len(manifest.files), 0, None, report.status,
                        default_threads(), deferred=report.deferred)


def scan_digests(snapshot: Path, manifest: Manifest, limit: int = SAMPLE_BYTES) -> str | None:
    """The whole-file verdict on a snapshot up to ``limit`` bytes (None above): what a verified-as-read
    load would find, found now. Not part of any timing."""
    return verify_snapshot(snapshot).status if manifest.total_bytes <= limit else None


@dataclass(frozen=True)
class HashRate:
    per_thread: float  # bytes/s of one hashing thread while ``threads`` hash at once
    threads: int
    sampled_bytes: int
    resident: float | None


def hash_rate(snapshot: Path, manifest: Manifest, threads: int, sample_bytes: int = HASH_SAMPLE_BYTES) -> HashRate:
    """One thread's hash rate while ``threads`` threads hash at once, as :func:`time_verify` samples: the
    largest files' first bytes, one thread each. Bytes-weighted over the threads (a tiny file's open
    would dominate a slowest-thread figure)."""
    sample = _sample(snapshot, manifest, sample_bytes, threads)
    resident = resident_fraction([(path, length) for path, length, _ in sample])
    with ThreadPoolExecutor(len(sample)) as pool:
        results = list(pool.map(lambda item: _hash_prefix(*item), sample))
    hashed, busy = sum(done for done, _ in results), sum(seconds for _, seconds in results)
    return HashRate(hashed / busy if busy > 0 else float("inf"), len(sample), hashed, resident)


def read_bandwidth(snapshot: Path, manifest: Manifest, sample_bytes: int = SAMPLE_BYTES) -> tuple[float, int, float | None]:
    """(bytes/s, bytes read, resident share) reading the snapshot's files, one thread, as a rank restores."""
    parts, left = [], sample_bytes
    for entry in sorted(manifest.files, key=lambda e: e.size, reverse=True):
        if left <= 0:
            break
        parts.append((snapshot / entry.path, min(entry.size, left)))
        left -= entry.size
    resident = resident_fraction(parts)
    buffer, done = bytearray(CHUNK), 0
    started = time.monotonic()
    for path, length in parts:
        with open(path, "rb", buffering=0) as stream:
            left = length
            while left > 0 and (count := stream.readinto(memoryview(buffer)[: min(CHUNK, left)])):
                done, left = done + count, left - count
    seconds = time.monotonic() - started
    return (done / seconds if seconds > 0 else float("inf")), done, resident


# --- processes ----------------------------------------------------------------------------


def _child_env(run_env: RunEnv | None = None, run_id: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}
    env.setdefault("PYTHONWARNINGS", "ignore")
    if run_env is not None:
        env.update(run_env.to_env())
    elif run_id is not None:
        env[variable("run_id")] = run_id
    return {**env, **_watched_by_this_process()}


def _watched_by_this_process() -> dict[str, str]:
    """The estimator is the relaunch's supervisor: its agent and ranks exit when it is gone (a SIGKILLed
    estimator leaves nothing behind), as a real attempt's do when its supervisor dies."""
    import psutil

    return {variable("supervisor_pid"): str(os.getpid()),
            variable("supervisor_start_time"): repr(psutil.Process().create_time())}


NoopTimes = relaunch.NoopTimes


def noop_attempt(world: int, spec: LaunchSpec | None, timeout: float = 120.0, store: Any = None) -> NoopTimes:
    """No-op ranks started the way a restart of this run starts them (warm standby, forked or spawned
    ranks: :mod:`ckptrun.cli.recovery_budget.rto_relaunch`), timed to ready, then torn down. ``store``: the
    run's object store, whose client every rank of such a run opens as it starts (s3fs and its imports)."""
    env = _child_env()
    if store is not None:
        env |= {variable("ckpt_url"): store.url.url, variable("storage_options"): json.dumps(store.options)}
    return relaunch.noop_attempt(world, spec, env, timeout)


@dataclass(frozen=True)
class ProbeTimes:
    seconds: float  # attempt start → restore done (the probe's measurement)
    restore_s: float  # reading and deserialising alone
    since_process_start: float | None
    world: int
    detail: str


def probe_run(spec: LaunchSpec, run_id: str, snapshot: Path, world: int, attempt_no: int, timeout: float) -> ProbeTimes:
    """Re-run the run's script on ``world`` ranks restoring ``snapshot``, stopped right after the restore.

    The probe's records go to a temporary run directory and its own empty
    checkpoint directory; the real snapshot is only read.
    """
    target = [str(spec.script or default_job()), *spec.script_args]
    probe_id = f"{run_id}-rto-probe-{uuid.uuid4().hex[:6]}"
    with tempfile.TemporaryDirectory(prefix="ckptrun-rto-probe-") as scratch:
        work = Path(scratch)
        env = RunEnv(run_id=probe_id, run_dir=work / "run", ckpt_dir=work / "checkpoints", attempt=attempt_no,
                     supervised=True, resume_from=snapshot, precision=spec.precision, seed=spec.seed,
                     deterministic=spec.deterministic, threads=spec.threads, hash_algorithm=spec.hash_algorithm,
                     allow_changes=tuple(spec.allow_changes), allow_reshard=True, exit_after_restore=True)  # any world size
        path = relaunch.relaunch_path(spec)  # started as a restart of the run would start it
        command = relaunch.attempt_command(path, spec, world, work, target)
        with relaunch.relaunched(path, probe_id, command, _child_env(env), work, timeout) as attempt:
            try:
                with contextlib.suppress(subprocess.TimeoutExpired):  # a probe past its allowance is torn down all the same
                    attempt.popen.wait(timeout=timeout)
            finally:
                attempt.teardown(spec.grace_period, probe_id)
        restored = records.read_events(work / "run", "probe_restored")
        if attempt.popen.returncode != 0 or not restored:
            raise CkptrunError(f"probe: the run's script did not restore {snapshot.name} on {world} rank(s) "
                               f"(exit code {attempt.popen.returncode}): {relaunch.tail(work / 'console.log')}",
                               "a real restart would fail the same way: run it by hand with "
                               f"{variable('exit_after_restore')}=1 to see the whole error", EXIT_NO)
        event = restored[-1]
        return ProbeTimes(float(event["time"]) - attempt.started, float(event.get("seconds", 0.0)),
                          _number(event.get("since_process_start")), world,
                          f"the run's script on {world} rank(s), relaunched on the {path.words}")


def probe_checkpoint(snapshot: Path, world: int, timeout: float) -> ProbeTimes:
    """``world`` processes at once, each loading the snapshot as a restoring rank does, with no user code."""
    command = [sys.executable, "-m", "ckptrun.cli.recovery_budget.rto_probe", "load", str(snapshot)]
    started = time.time()
    children = [subprocess.Popen(command, env=_child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for _ in range(world)]
    reports = []
    for child in children:
        try:
            out, err = child.communicate(timeout=max(1.0, timeout - (time.time() - started)))
        except subprocess.TimeoutExpired:
            for other in children:
                other.kill()
            raise CkptrunError(f"probe: loading {snapshot.name} took longer than {timeout:g}s",
                               "the restore alone exceeds that; check the storage, or raise the time allowed") from None
        if child.returncode != 0:
            last = err.strip().splitlines()[-1] if err.strip() else f"exit code {child.returncode}"
            raise CkptrunError(f"probe: {snapshot.name} does not load: {last}",
                               f"a restart would fail the same way; inspect it with `ckptrun verify {snapshot}`", EXIT_NO)
        reports.append(json.loads(out.strip().splitlines()[-1]))
    slowest = max(reports, key=lambda r: r["time"])
    detail = (f"{world} process(es) loading with the runtime's loader: start {slowest['python_start_s']:.2f} s + "
              f"import torch {slowest['import_s']:.2f} s + load {slowest['load_s']:.2f} s")
    return ProbeTimes(slowest["time"] - started, slowest["load_s"], slowest["since_process_start"], world, detail)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None
