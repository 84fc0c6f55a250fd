"""Each part of the recovery estimate, with its value and where the value comes from.

Preference, per component: this run's own history (what past restarts
measured) over a measurement made now on this machine over a configured or
assumed figure — and each :class:`~ckptrun.cli.recovery_budget.rto_model.Component` says
which, naming the assumption. :class:`Target` is what the command found at
PATH: a run directory (records, maybe ``run.json``) or a bare checkpoint
directory. Importable without torch; torch runs only in the probes' children.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptrun.cli.durations import format_duration as fmt
from ckptrun.cli.errors import EXIT_NO, CkptrunError
from ckptrun.cli.humanize import human_bytes
from ckptrun.cli.recovery_budget import rto_history as hist
from ckptrun.cli.recovery_budget import rto_measure as measure
from ckptrun.cli.recovery_budget import rto_relaunch
from ckptrun.cli.recovery_budget.rto_relaunch import RelaunchPath
from ckptrun.cli.recovery_budget.rto_model import ASSUMED, CONFIGURED, ESTIMATED, HISTORY, MEASURED, UNKNOWN, Component, lost_work
from ckptrun.cli.supervision.attempt import FAILED_GRACE_S
from ckptrun.cli.supervision.policy import STACK_WAIT_S, RestartPolicy, Timeouts
from ckptrun.cli.supervision.spec import LaunchSpec
from ckptrun.runtime.manifest import Manifest
from ckptrun.runtime.checkpoint.verified_read import HASH_THREADS

PROBE_TIMEOUT_S = 600.0
# A crash's teardown on CPU (gloo) ranks before a restart measured one (bench/rto_accuracy.py: 0.21-0.46 s on 2
# CPUs); a no-op relaunch's idle tree takes 0.08-0.18 s, under every scenario's, so on CPU this is its floor.
CPU_CRASH_TEARDOWN_S = 0.4


@dataclass
class Target:
    """What estimate-rto looks at: the snapshot a restart would restore, and the records around it."""

    path: Path
    kind: str  # "run" | "checkpoint"
    ckpt_dir: Path
    snapshot: Path
    manifest: Manifest
    run_dir: Path | None = None
    run_id: str | None = None
    spec: LaunchSpec | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    created: list[tuple[int, float]] = field(default_factory=list)  # (step, created) of the lineage's snapshots
    older: list[tuple[Path, Manifest]] = field(default_factory=list)  # fallbacks, newest first
    fetched: Any = None  # an object store's restore choice (runtime.tiering.Choice), done and timed
    store: Any = None  # the run's object store (FsspecStore): a restart's ranks open its client as they start

    @property
    def restarts(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == "restart"]

    def setting(self, name: str) -> tuple[Any, str, str]:
        """A launch setting: (value, source, words), from run.json or the launch default."""
        if self.spec is not None:
            return getattr(self.spec, name), CONFIGURED, "run.json"
        return LaunchSpec.model_fields[name].default, ASSUMED, "the launch default; no run.json"


def say(line: str) -> None:
    """Narration on stderr (stdout is the report)."""
    sys.stderr.write(f"ckptrun: {line}\n")
    sys.stderr.flush()


# --- detect, teardown, backoff ------------------------------------------------------


# A hang's stack dump (World.dump_stacks): it ends once every rank's log grew and then stayed unchanged for
# 0.2 s, sampled every 0.1 s — about 0.45 s measured here (bench/rto_accuracy.py, scenario hang) — and at most
# STACK_WAIT_S. The supervisor counts it in the hang's teardown, after the detection.
STACK_DUMP_S = 0.45


def detect(target: Target) -> Component:
    poll = Timeouts().poll
    timeout, source, where = target.setting("heartbeat_timeout")
    hang_detect = float(timeout) + poll / 2  # the rank's last beat, then the timeout; seen at the next poll
    hang = hang_detect + STACK_DUMP_S
    hang_words = (f"hang: heartbeat timeout {fmt(timeout)} ({where}) + stack dump {fmt(STACK_DUMP_S)} (modelled: "
                  f"the dump ends once every rank printed; at most {fmt(STACK_WAIT_S)}), {fmt(hang)}")
    facts = {"poll_s": poll, "heartbeat_timeout_s": float(timeout), "hang_detect_s": hang_detect,
             "stack_dump_s": STACK_DUMP_S, "hang_s": hang}
    crashes = [r for r in target.restarts if r.get("cause") in (None, "crash")]
    value, count = hist.restart_figure(crashes, "detect_s")
    if value is not None:
        return Component("detect", value, HISTORY, f"crash: median of {count} past restart(s); {hang_words}", facts)
    return Component("detect", poll, ASSUMED, f"crash: found within one supervisor poll ({fmt(poll)}); {hang_words}", facts)


def teardown(target: Target, noop: measure.NoopTimes | None) -> Component:
    grace, _, where = target.setting("grace_period")
    value, count = hist.restart_figure(target.restarts, "teardown_s")
    facts = {"bound_s": float(grace)}
    if value is not None:
        return Component("teardown", value, HISTORY,
                         f"median of {count} past restart(s); bound: grace period {fmt(grace)}", facts)
    if noop is not None and hist.device(target.events) == "cpu" and noop.teardown_s < CPU_CRASH_TEARDOWN_S:
        return Component("teardown", CPU_CRASH_TEARDOWN_S, ESTIMATED,
                         f"a crash's teardown on CPU ranks {fmt(CPU_CRASH_TEARDOWN_S)} (modelled: the survivors leave a "
                         f"broken gloo collective and exit on SIGTERM; 0.21-0.46 s measured here), not the no-op "
                         f"{noop.world}-rank tree's {fmt(noop.teardown_s)} ({noop.path.words}: idle, nothing to "
                         f"leave); bound: grace period {fmt(grace)} ({where})", {**facts, "noop_teardown_s": noop.teardown_s})
    if noop is not None:
        return Component("teardown", noop.teardown_s, MEASURED,
                         f"the supervisor's teardown of a no-op {noop.world}-rank torchrun tree ({noop.path.words}); "
                         f"bound: grace period {fmt(grace)} ({where})", facts)
    bound = (f"bound: SIGKILL {fmt(FAILED_GRACE_S)} after SIGTERM (the grace period {fmt(grace)} ({where}) bounds a "
             "stop's teardown, not a failed attempt's)")
    if hist.device(target.events) == "cpu":
        return Component("teardown", CPU_CRASH_TEARDOWN_S, ESTIMATED,
                         f"a crash's teardown on CPU ranks {fmt(CPU_CRASH_TEARDOWN_S)} (modelled: torchrun sees the dead "
                         f"rank, the survivors leave their collective on the broken connection and exit on SIGTERM; "
                         f"0.21-0.46 s measured here); {bound}", facts)
    return Component("teardown", FAILED_GRACE_S, CONFIGURED,
                     f"a crash's teardown: the survivors get SIGTERM, then SIGKILL after {fmt(FAILED_GRACE_S)} (a rank "
                     f"waiting on a GPU collective does not return to take SIGTERM); {bound}", facts)


def backoff(target: Target) -> Component:
    first, source, where = target.setting("restart_backoff")
    cap, _, _ = target.setting("restart_backoff_cap")
    policy = RestartPolicy(backoff=float(first), backoff_cap=float(cap))
    return Component("backoff", policy.delay(1), source,
                     f"none before the first restart; {fmt(first)} before the second ({where}), doubling per restart "
                     f"up to {fmt(cap)}", {"cap_s": float(cap)})


# --- verify ---------------------------------------------------------------------------


def verify(target: Target) -> Component:
    """Time the supervisor's choice: check the newest snapshot, falling back to older ones it could use.

    Schema 2: every digest, hashed whole, before the relaunch. Schema 3 (chunk digests): manifest and sizes
    only, what the supervisor runs; the ranks hash as they load (in the restart's restore). A fallback moves
    ``target.snapshot`` to the snapshot a restart would really restore.
    """
    if target.fetched is not None:
        return _fetched(target.fetched)
    timing, refused = _check(target.snapshot, target.manifest)
    spent, skipped = timing.seconds, []
    for path, manifest in target.older if refused else []:
        skipped.append(refused)
        target.snapshot, target.manifest = path, manifest
        timing, refused = _check(path, manifest)
        spent += timing.seconds
        if refused is None:
            break
    if refused is not None:
        raise CkptrunError(f"no snapshot of the current lineage in {target.ckpt_dir} verifies: a failure now restarts "
                           "from the beginning", f"see `ckptrun verify {target.ckpt_dir}`", EXIT_NO)
    how = _verify_words(timing, target.manifest)
    if skipped:
        how = (f"WARNING: {'; '.join(skipped)}: a restart falls back to {target.snapshot.name} "
               f"(see `ckptrun verify {target.ckpt_dir}`); then " + how)
    past, count = hist.restart_figure(target.restarts, "verify_s")
    if past is not None:
        how += f"; past restarts: median {fmt(past)} over {count}"
    facts = {"bytes": timing.bytes, "rule": MANIFEST_AND_SIZES if timing.deferred else WHOLE_FILE_DIGESTS,
             "throughput_bytes_per_s": None if timing.deferred else timing.throughput,
             "page_cache_resident": timing.resident, "sampled": timing.status is None, "skipped": skipped}
    return Component("verify", spent, MEASURED, how, facts)


MANIFEST_AND_SIZES, WHOLE_FILE_DIGESTS = "manifest-and-sizes", "whole-file-digests"


def _check(path: Path, manifest: Manifest) -> tuple[measure.VerifyTiming, str | None]:
    """The supervisor's check of one snapshot, timed, and why a restart could not use it (None: it could).

    A schema-3 snapshot whose bytes are damaged passes manifest and sizes, so the relaunch would fail at load
    and the supervisor quarantine it: a small one is hashed now (untimed) to say so and model the fallback.
    """
    if not manifest.verified_as_loaded:
        timing = measure.time_verify(path, manifest)
        return timing, None if timing.status in (None, "ok") else f"{path.name} is {timing.status}"
    timing = measure.time_load_check(path, manifest)
    if timing.status != "ok":
        return timing, f"{path.name} is {timing.status}"
    found = measure.scan_digests(path, manifest)
    if found not in (None, "ok"):
        return timing, (f"{path.name} is {found} (its manifest and sizes pass the pre-relaunch check, so the "
                        "relaunched ranks fail loading it and the supervisor quarantines it: one more attempt)")
    return timing, None


def _verify_words(timing: measure.VerifyTiming, manifest: Manifest) -> str:
    if timing.deferred:
        return (f"schema {manifest.schema_version}, chunk digests: manifest and sizes of {timing.files} files checked "
                f"before the relaunch ({human_bytes(timing.bytes)} not hashed here: each rank verifies what it "
                "loads as it reads it, counted in restart)")
    algorithms = ",".join(sorted({e.algorithm for e in manifest.files}))
    how = (f"schema {manifest.schema_version}, whole-file digests: {human_bytes(timing.bytes)} in {timing.files} files, "
           f"{algorithms} at {timing.throughput / 1e6:,.0f} MB/s ({timing.threads} threads), "
           f"{measure.cache_words(timing.resident)}")
    if timing.status is None:
        how += f"; sampled {human_bytes(timing.sampled_bytes)} and extrapolated"
    return how


def _fetched(choice: Any) -> Component:
    """An object store: the supervisor's choice is list + (verify the local copy | download and hash), measured."""
    rate = choice.bytes / choice.seconds if choice.seconds > 0 else 0.0
    action = "downloaded and hashed" if choice.source == "remote" else "hashed (local copy)"
    how = (f"{choice.source}: {choice.reason}; {human_bytes(choice.bytes)} {action} at {rate / 1e6:,.0f} MB/s "
           f"from {choice.remote}")
    return Component("verify", choice.seconds, MEASURED, how,
                     {"bytes": choice.bytes, "throughput_bytes_per_s": rate, "source_of_restore": choice.source, "skipped": []})


# --- restart ------------------------------------------------------------------------------


def first_step(target: Target) -> tuple[float, str]:
    """Seconds from restore to the end of the first step after it, and how that is known."""
    value, count = hist.restart_figure(target.restarts, "first_step_s")
    if value is None:
        value, count = hist.first_step_after_restore(target.events, target.metrics)
    if value is not None:
        return value, f"first step after a restore {fmt(value)} (history, {count})"
    step = hist.step_time(target.metrics)
    if step is not None:
        return step, f"first step ≈ one step {fmt(step)} (history; assumed: no slower than the others)"
    return 0.0, "first step not included (no step records)"


def setup_and_first_step(target: Target) -> tuple[float, str]:
    """Seconds from ``init()`` to the end of the first step: the script's own set-up plus one step."""
    value, count = hist.setup_and_first_step(target.events, target.metrics)
    if value is not None:
        return value, f"set-up and first step {fmt(value)} (history, {count} attempt(s))"
    step = hist.step_time(target.metrics)
    if step is not None:
        return step, f"first step ≈ one step {fmt(step)} (history; the script's set-up not included)"
    return 0.0, "the script's set-up and first step not included (no step records)"


def restart(target: Target, probe: bool, world: int, noop: measure.NoopTimes | None) -> Component:
    """History first; an explicit ``--probe`` measures anyway (history then shows beside it)."""
    value, count = hist.restart_figure(target.restarts, "relaunch_to_first_step_s")
    if probe:
        probed = _probed(target, world)
        if value is not None:
            probed.detail += f"; past restarts: median {fmt(value)} over {count}"
        return probed
    if value is not None:
        medians = {name: hist.restart_figure(target.restarts, f"{name}_s")[0] for name in ("startup", "restore", "first_step")}
        parts = ", ".join(f"{name} {fmt(seconds)}" for name, seconds in medians.items() if seconds is not None)
        path, where = relaunch_path(target)
        return Component("restart", value, HISTORY, f"relaunch to first step, median of {count} past restart(s)"
                         + (f" ({parts})" if parts else "") + f"; those restarts ran the {path.words} ({where})",
                         {"relaunch_path": path.name, "standby": path.standby})
    return _estimated(target, noop, world)


def relaunch_path(target: Target) -> tuple[RelaunchPath, str]:
    """The path a restart of this run takes (warm or cold ranks, standby or not), and where that is known from."""
    _, _, where = target.setting("warm_workers")
    return rto_relaunch.relaunch_path(target.spec), where


def _probed(target: Target, world: int) -> Component:
    if target.spec is not None:
        say(f"probe: running the run's script on {world} rank(s) to restore {target.snapshot.name} (then it stops)")
        attempts = [int(e.get("attempt", 0)) for e in target.events if e.get("event") == "attempt_start"]
        times = measure.probe_run(target.spec, target.run_id or "run", target.snapshot, world, max(attempts, default=1) + 1,
                                  PROBE_TIMEOUT_S)
        step, step_words = first_step(target)
        how = (f"{times.detail}: start-up and restore {fmt(times.seconds)} (restore alone {fmt(times.restore_s)}) "
               f"+ {step_words}")
    else:
        say(f"probe: loading {target.snapshot.name} in {world} process(es), no user code")
        times = measure.probe_checkpoint(target.snapshot, world, PROBE_TIMEOUT_S)
        step, step_words = first_step(target)
        why = "no run.json to re-run the script from, so " if target.kind == "run" else ""
        how = f"{times.detail}; {step_words}; {why}process-group init and the script's set-up not included (no user code)"
    return Component("restart", times.seconds + step, MEASURED, how,
                     {"probe_s": times.seconds, "restore_s": times.restore_s, "world_size": times.world})


def _estimated(target: Target, noop: measure.NoopTimes | None, world: int) -> Component:
    restore, restore_words, restore_facts = restore_estimate(target, world)
    step, step_words = setup_and_first_step(target) if target.kind == "run" else first_step(target)
    launch = noop.launch_s if noop is not None else 0.0
    path, where = relaunch_path(target)  # what the no-op relaunch ran, too
    store = " (each opened the run's object store, as its ranks do)" if noop is not None and noop.opened_store else ""
    how = (f"no-op {noop.world}-rank relaunch{store} to process group {fmt(launch)} (measured) + " if noop else "") + (
        f"{restore_words} + {step_words}; modelled relaunch: {path.words} ({where}); --probe measures it for real")
    return Component("restart", launch + restore + step, ESTIMATED, how,
                     {"launch_s": launch, **restore_facts, "first_step_s": step, "relaunch_path": path.name,
                      "standby": path.standby, "noop_opened_store": bool(noop and noop.opened_store)})


def restore_estimate(target: Target, world: int) -> tuple[float, str, dict[str, Any]]:
    """Seconds to restore the snapshot, measured now on its files, with the rule that applied.

    Schema 2: its bytes at one thread's read bandwidth (hashed before the relaunch, not while loading).
    Schema 3: the slower of reading and hashing as read, which overlap: each rank hashes its items on up to
    ``HASH_THREADS`` threads, and the node runs at most one thread per CPU, so a rank gets
    min(CPUs, ranks × HASH_THREADS) / ranks threads' worth of hashing.
    """
    manifest, total_bytes = target.manifest, target.manifest.total_bytes
    bandwidth, _, resident = measure.read_bandwidth(target.snapshot, manifest)
    read_s = total_bytes / bandwidth
    read_words = f"bytes at {bandwidth / 1e9:.2f} GB/s read, {measure.cache_words(resident)}"
    facts: dict[str, Any] = {"restore_s": read_s, "read_bytes_per_s": bandwidth}
    if not manifest.verified_as_loaded:
        return read_s, (f"restore {fmt(read_s)} ({read_words}; schema {manifest.schema_version}: hashed whole before "
                        "the relaunch, not while loading)"), {**facts, "restore_rule": "read"}
    ranks = max(1, world // _nodes(target))
    cpus = os.cpu_count() or 1
    concurrent = min(cpus, ranks * HASH_THREADS)
    rate = measure.hash_rate(target.snapshot, manifest, concurrent)
    per_rank = rate.per_thread * concurrent / ranks
    hash_s = total_bytes / per_rank
    restore = max(read_s, hash_s)
    slower = "hashing" if hash_s > read_s else "reading"
    words = (f"restore {fmt(restore)} = the slower ({slower}) of reading {fmt(read_s)} ({read_words}) and hashing as "
             f"read {fmt(hash_s)} (schema 3, chunk digests: {rate.per_thread / 1e6:,.0f} MB/s per thread with "
             f"{rate.threads} hashing at once × {concurrent / ranks:.2g} thread(s) per rank: {ranks} rank(s) × up to "
             f"{HASH_THREADS} hash threads on {cpus} CPUs)")
    return restore, words, {**facts, "restore_s": restore, "restore_rule": "slower-of-read-and-hash", "read_s": read_s,
                            "hash_s": hash_s, "hash_bytes_per_s_per_thread": rate.per_thread,
                            "hash_threads_per_rank": concurrent / ranks}


def _nodes(target: Target) -> int:
    return int(target.spec.nnodes.split(":")[-1]) if target.spec is not None else 1


# --- lost work ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Cadence:
    """τ, δ, w and the step time, each with where it came from."""

    interval_s: float | None
    interval_steps: float | None
    stall_s: float
    persist_s: float
    mode: str
    step_s: float | None
    source: str
    words: str


def cadence(target: Target) -> Cadence:
    step = hist.step_time(target.metrics)
    if target.kind == "checkpoint":
        seconds, steps = hist.manifest_cadence(target.created)
        source = HISTORY if seconds is not None else UNKNOWN
        per_step = seconds / steps if seconds is not None and steps else None
        return Cadence(seconds, steps, 0.0, 0.0, "sync", per_step, source,
                       "τ from the snapshots' creation times (includes each save; assumed δ = 0, no save records)"
                       if seconds is not None else "one snapshot only: the save interval is unknown")
    facts = hist.save_facts(target.events)
    stall, persist = facts.stall_s or 0.0, facts.persist_s
    stall_words = (f"δ {fmt(stall)} ({facts.mode} saves, median of {facts.saves})" if facts.stall_s is not None
                   else "δ assumed 0 (no save records)")
    if facts.interval_s is not None:
        return Cadence(facts.interval_s, facts.interval_steps, stall, persist, facts.mode, step, HISTORY,
                       f"τ from {facts.intervals} interval(s) between saves, {stall_words}")
    every_s, source, where = target.setting("save_every_seconds")
    every_steps, _, _ = target.setting("save_every_steps")
    if every_s is not None:
        return Cadence(float(every_s), every_s / step if step else None, stall, persist, facts.mode, step, source,
                       f"τ = --save-every-seconds ({where}), {stall_words}")
    if every_steps is not None and step is not None:
        return Cadence(every_steps * step, float(every_steps), stall, persist, facts.mode, step, ESTIMATED,
                       f"τ = --save-every-steps {every_steps} × step {fmt(step)}, {stall_words}")
    return Cadence(None, None, stall, persist, facts.mode, step, UNKNOWN, "fewer than two saves and no cadence known")


def lost(target: Target, pace: Cadence) -> Component:
    facts = {"interval_s": pace.interval_s, "interval_steps": pace.interval_steps, "stall_s": pace.stall_s,
             "persist_s": pace.persist_s, "save_mode": pace.mode, "step_s": pace.step_s}
    past, count = hist.restart_figure(target.restarts, "lost_steps")
    if pace.interval_s is None:
        unknown = {"worst_s": None, "steps": None, "worst_steps": None}
        return Component("lost_work", None, UNKNOWN, pace.words, {**facts, **unknown})
    expected, worst = lost_work(pace.interval_s, pace.persist_s)
    steps = (expected / pace.step_s, worst / pace.step_s) if pace.step_s else (None, None)
    how = f"τ/2 + w with τ {fmt(pace.interval_s)}, w {fmt(pace.persist_s)}: {pace.words}; worst τ + w = {fmt(worst)}"
    if steps[0] is not None:
        how += f"; ≈ {steps[0]:.1f} steps (worst {steps[1]:.1f})"
    if past is not None:
        how += f"; past restarts lost {past:g} steps (median of {count})"
    return Component("lost_work", expected, pace.source, how,
                     {**facts, "worst_s": worst, "steps": steps[0], "worst_steps": steps[1]})
