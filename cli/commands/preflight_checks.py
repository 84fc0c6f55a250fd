"""The six verdicts of ``ckptrun preflight``, each read from the records of the scratch runs it made.

Every check is a function of run directories (and the launch spec) to one
:class:`Check`: ``pass``, ``warn``, ``fail`` or ``skipped``, the measured
figure, and the reason in words a person can act on. The scratch runs are
``learn`` (the first batch repeated, :mod:`ckptrun.runtime.step.preflight`) and
``resume`` (saved, killed after three more steps, restored, replayed). The
arithmetic is the rest of ckptrun's: the resume verdict of
:mod:`~ckptrun.cli.supervision.resume_check`, the RTO model of ``estimate-rto``, the
per-op report of ``precision-report``. Importable without torch.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ckptrun.cli.commands.precision_report import REPORT as PRECISION_REPORT
from ckptrun.cli.durations import format_duration
from ckptrun.cli.errors import CkptrunError
from ckptrun.cli.humanize import human_bytes
from ckptrun.cli.recovery_budget.estimate import build_report, find_target
from ckptrun.cli.recovery_budget.rto_model import RTO_PARTS, budget_verdict
from ckptrun.cli.supervision.memory_tier import SHM_ROOT
from ckptrun.cli.supervision.recovery import CUT
from ckptrun.cli.supervision.resume_check import DIVERGED, resume_verdict
from ckptrun.runtime import records
from ckptrun.runtime.step.preflight import read_digests

PASS, WARN, FAIL, SKIPPED = "pass", "warn", "fail", "skipped"
NAMES = ("learns", "resumes", "speed", "snapshot", "budgets", "precision")  # the order of the table
WARMUP_STEPS = 5  # step times before this are compile, allocator and loader warm-up
NEEDS_RUNTIME = "plain script: needs ckptrun.runtime (ckr.init, run.track, run.batches)"
STATE_NAMES = {"lr": "scheduler (learning rate)", "scheduler": "scheduler", "loader": "data position", "rng": "RNG",
               "optimizer": "optimizer", "model": "model", "ema": "EMA", "scaler": "grad scaler"}


@dataclass
class Check:
    name: str
    verdict: str
    figure: str
    reason: str
    facts: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def plain(run_dir: Path) -> bool:
    """The script never called the runtime: its step records come from the optimizer-step hook."""
    steps = [r for r in records.read_metrics(run_dir) if "step" in r]
    return bool(steps) and all(r.get("source") == "step-hook" for r in steps)


# --- 1 learns ---------------------------------------------------------------------------


def learns(run_dir: Path, fall: float) -> Check:
    """The first batch, repeated: the loss must fall by ``fall`` of its first value, and stay finite."""
    steps = sorted((r for r in records.read_metrics(run_dir) if "loss" in r), key=lambda r: r["step"])
    if not steps:
        return Check("learns", SKIPPED, "-", NEEDS_RUNTIME if plain(run_dir) else "no step logged a loss")
    if not records.read_events(run_dir, "preflight"):
        return Check("learns", SKIPPED, "-", "the loop does not use run.batches, so one batch cannot be repeated")
    for record in steps:
        for key in ("loss", "grad_norm"):
            value = record.get(key)
            if isinstance(value, (int, float)) and not math.isfinite(value):
                return Check("learns", FAIL, f"{key} {value} at step {record['step']}",
                             f"non-finite {key.replace('_', ' ')} at step {record['step']} on one repeated batch",
                             {"step": record["step"]})
    first, last = steps[0]["loss"], steps[-1]["loss"]
    dropped = (first - last) / abs(first) if first else 0.0
    figure = f"loss {first:.3g} → {last:.3g} in {len(steps)} steps ({dropped:.0%} fall)"
    facts = {"first_loss": first, "last_loss": last, "steps": len(steps), "fall": dropped, "required_fall": fall}
    if dropped >= fall:
        return Check("learns", PASS, figure, f"overfits one batch (needs a {fall:.0%} fall)", facts)
    return Check("learns", FAIL, figure, f"cannot overfit one batch (needs a {fall:.0%} fall): is the output detached "
                 "from the graph, or the optimizer given other parameters?", facts)


# --- 2 resumes exactly -------------------------------------------------------------------


def resumes(run_dir: Path, deterministic: bool) -> Check:
    """Losses of the replayed steps, and each state's digest, before the kill and after the restore."""
    by_attempt = records.losses_by_attempt(run_dir)
    restored = records.read_events(run_dir, "restored")
    if len(by_attempt) < 2 or not restored:
        if plain(run_dir):
            return Check("resumes", SKIPPED, "-", NEEDS_RUNTIME)
        return Check("resumes", FAIL, "no restore", "the killed job was not restored from its snapshot: "
                     f"see {run_dir / 'events.jsonl'}")
    step = int(restored[0]["step"])
    original = {s: v for s, v in by_attempt[1].items() if s > step}
    replayed = {s: v for s, v in by_attempt[2].items() if s in original}
    precision = next((r.get("precision") for r in records.read_metrics(run_dir) if r.get("precision")), None)
    verdict = resume_verdict(original, replayed, deterministic, precision)
    lost = _states_lost(read_digests(run_dir), step)
    same = "bitwise equal" if verdict.verdict == "exact" else f"max rel diff {verdict.max_rel_diff or 0:.3g}"
    figure = f"{verdict.replayed_steps} steps replayed from step {step}: {same}"
    facts = {"restored_step": step, "verdict": verdict.verdict, "max_rel_diff": verdict.max_rel_diff,
             "tolerance": verdict.tolerance, "states_lost": lost}
    if lost:
        names = ", ".join(STATE_NAMES.get(name, name) for name in lost["states"])
        hint = " — track it: run.track(scheduler=...)" if lost["states"] == ["lr"] else ""
        return Check("resumes", FAIL, figure, f"{names} did not come back: differs at step {lost['step']} after "
                     f"the restore{hint}", facts)
    if verdict.verdict is None:
        return Check("resumes", FAIL, figure, f"no step after the restored step {step} was replayed", facts)
    if verdict.verdict == DIVERGED:
        return Check("resumes", FAIL, figure, "the replayed losses differ although every tracked state came back: "
                     "some state is not tracked (a module, a global, a data source outside ckr.DataLoader)", facts)
    how = "exact bitwise (deterministic)" if verdict.tolerance is None else f"within {verdict.tolerance:g} ({precision})"
    return Check("resumes", PASS, figure, f"kill, relaunch, restore: {how}; every state came back", facts)


def _states_lost(digests: dict[int, dict[int, dict[str, str]]], restored: int) -> dict[str, Any] | None:
    """The first step after the restore where a state's digest differs from the first attempt's, and which."""
    before, after = digests.get(1, {}), digests.get(2, {})
    for step in sorted(set(before) & set(after)):
        if step < restored:
            continue
        differ = sorted(name for name in set(before[step]) | set(after[step]) if before[step].get(name) != after[step].get(name))
        if differ:
            ordered = [name for name in ("scheduler", "lr") if name in differ]  # a scheduler moves the lr: name it first
            return {"step": step, "states": ordered if ordered else differ}
    return None


# --- 3 speed ------------------------------------------------------------------------------


def speed(run_dir: Path, script_steps: int | None) -> Check:
    """Median seconds per step after warm-up (from step record times, so plain scripts too) and the time to finish."""
    points = [(int(r["step"]), float(r["time"])) for r in records.read_metrics(run_dir)
              if "step" in r and isinstance(r.get("time"), (int, float)) and int(r["step"]) > WARMUP_STEPS]
    per_step = [(t2 - t1) / (s2 - s1) for (s1, t1), (s2, t2) in zip(points, points[1:]) if s2 > s1]
    if not per_step:
        return Check("speed", WARN, "-", f"fewer than {WARMUP_STEPS + 2} steps ran: no rate after warm-up")
    median = statistics.median(per_step)
    rates = [r["samples_per_s"] for r in records.read_metrics(run_dir) if r.get("samples_per_s") and r["step"] > WARMUP_STEPS]
    samples = f", {statistics.median(rates):.0f} samples/s" if rates else ""
    facts = {"step_s": median, "samples_per_s": statistics.median(rates) if rates else None, "script_steps": script_steps,
             "finish_s": median * script_steps if script_steps else None, "runtime_share": None}
    figure = f"{median * 1000:.1f} ms/step{samples}"
    if script_steps:
        return Check("speed", PASS, figure, f"--steps {script_steps} take {format_duration(median * script_steps)} at "
                     "this rate (the runtime's own share is not measured separately)", facts)
    return Check("speed", WARN, figure, "the script's step count is unknown (an epoch loop or a plain script): "
                 "no time to finish", facts)


# --- 4 snapshot ---------------------------------------------------------------------------


def snapshot(run_dir: Path, ckpt_dir: Path) -> Check:
    """Size, stall, background persist and restore time from the events; verify speed measured now."""
    from ckptrun.runtime.storage.store import list_entries
    from ckptrun.runtime.checkpoint.verify import verify_snapshot

    saved, restored = records.read_events(run_dir, "snapshot_saved"), records.read_events(run_dir, "restored")
    failed = records.read_events(run_dir, "save_failed")
    if not saved:
        if plain(run_dir):
            return Check("snapshot", SKIPPED, "-", NEEDS_RUNTIME)
        reason = failed[0].get("error") if failed else "no snapshot was published"
        return Check("snapshot", FAIL, "-", f"saving failed: {reason}")
    first = saved[0]
    published = [e.path for e in list_entries(ckpt_dir) if e.kind == "published"]
    if not published:
        return Check("snapshot", FAIL, "-", f"{ckpt_dir} holds no published snapshot after {len(saved)} save(s)")
    newest, started = published[-1], time.monotonic()
    report = verify_snapshot(newest)
    verify_s = max(time.monotonic() - started, 1e-9)
    facts = {"bytes": first["bytes"], "stall_s": first["stall_s"], "persist_s": first.get("write_s"),
             "asynchronous": first.get("asynchronous"), "restore_s": restored[0]["seconds"] if restored else None,
             "verify_bytes_per_s": first["bytes"] / verify_s, "staging_bytes": first.get("staging_allocated_bytes")}
    mode = "background" if first.get("asynchronous") else "inline"
    restore = f", restore {facts['restore_s']:.2f}s" if facts["restore_s"] is not None else ""
    figure = (f"{human_bytes(first['bytes'])}, stall {first['stall_s'] * 1000:.0f} ms, {mode} persist "
              f"{(first.get('write_s') or 0):.2f}s{restore}, verify {facts['verify_bytes_per_s'] / 1e6:.0f} MB/s")
    if not report.ok:
        return Check("snapshot", FAIL, figure, f"{newest.name} does not verify: {'; '.join(report.problems)}", facts)
    if failed:
        return Check("snapshot", FAIL, figure, f"a save failed: {failed[0].get('error')}", facts)
    return Check("snapshot", PASS, figure, "saved, verified (page-cached read) and restored", facts)


# --- 5 budgets ----------------------------------------------------------------------------


def budgets(spec: Any, snap: Check, resume_dir: Path, script_steps: int | None, free_bytes: int | None) -> Check:
    """Disk for the retained snapshots, host memory for staging, and the RTO against --rto-budget."""
    if snap.verdict == SKIPPED or "bytes" not in snap.facts:
        return Check("budgets", SKIPPED, "-", "no snapshot to size the budgets by" if snap.verdict != SKIPPED else NEEDS_RUNTIME)
    parts = [_disk(spec, snap.facts["bytes"], script_steps, free_bytes), _memory(snap.facts)]
    parts += [_memory_tier(spec, snap.facts["bytes"])] if spec.memory_every_steps else []
    parts.append(_rto(spec, resume_dir))
    verdict = FAIL if any(p[0] == FAIL for p in parts) else WARN if any(p[0] == WARN for p in parts) else PASS
    worst = [p for p in parts if p[0] == verdict] or parts
    facts = {k: v for p in parts for k, v in p[3].items()}
    return Check("budgets", verdict, "; ".join(p[1] for p in parts), "; ".join(p[2] for p in worst), facts)


def _disk(spec: Any, size: int, script_steps: int | None, free_bytes: int | None) -> tuple[str, str, str, dict[str, Any]]:
    milestones = script_steps // spec.keep_every if spec.keep_every and script_steps else 0
    need = size * (spec.keep_last + milestones + 1)
    where = _existing(Path(spec.ckpt_dir or spec.run_dir or "runs"))
    free = free_bytes if free_bytes is not None else shutil.disk_usage(where).free
    figure = f"disk {human_bytes(need)} of {human_bytes(free)}"
    what = f"{spec.keep_last} kept + {milestones} milestones + 1 in flight"
    facts = {"disk_need_bytes": need, "disk_free_bytes": free, "disk_path": str(where)}
    if need > free:
        return FAIL, figure, f"the disk cannot hold {what}: free space or lower --keep-last", facts
    if free < 2 * need:
        return WARN, figure, f"under 2× the space for {what}", facts
    return PASS, figure, f"disk holds {what}", facts


def _existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def _memory(facts: dict[str, Any]) -> tuple[str, str, str, dict[str, Any]]:
    import psutil

    need, free = facts.get("staging_bytes") or facts["bytes"], psutil.virtual_memory().available
    figure = f"memory {human_bytes(need)} of {human_bytes(free)}"
    out = {"staging_need_bytes": need, "memory_available_bytes": free}
    if need > free:
        return FAIL, figure, "host memory cannot stage a snapshot: use --sync-save or smaller state", out
    if free < 2 * need:
        return WARN, figure, "under 2× the host memory staging needs", out
    return PASS, figure, "memory stages a snapshot", out


def _memory_tier(spec: Any, size: int, root: Path = SHM_ROOT) -> tuple[str, str, str, dict[str, Any]]:
    """--memory-keep snapshots plus one being written, in the free space of /dev/shm (it is host memory)."""
    need, free = size * (spec.memory_keep + 1), shutil.disk_usage(root).free
    figure = f"{root} {human_bytes(need)} of {human_bytes(free)}"
    facts = {"memory_tier_need_bytes": need, "memory_tier_free_bytes": free}
    if need > free:
        return FAIL, figure, (f"{root} cannot hold --memory-keep {spec.memory_keep} memory snapshots + 1 in flight: "
                              "lower --memory-keep or --memory-every-steps 0"), facts
    return PASS, figure, f"{root} holds the memory tier", facts


def _rto(spec: Any, resume_dir: Path) -> tuple[str, str, str, dict[str, Any]]:
    try:
        target = find_target(resume_dir)
    except CkptrunError as exc:
        return WARN, "RTO ?", f"no RTO estimate: {exc}", {"rto_s": None}
    report = build_report(target, False, target.manifest.world_size, spec.mtbf)
    rto, advice = report["totals"]["rto_s"], report["recommendation"]
    values = {name: report["components"][name]["value_s"] or 0.0 for name in RTO_PARTS}
    daly = f", Daly {format_duration(advice['interval_s'])} at MTBF {format_duration(spec.mtbf)}" if advice else ""
    gain = f", goodput {advice['goodput']:.4f}" if advice and advice.get("goodput") is not None else ""
    figure = f"RTO {format_duration(rto) if rto is not None else '?'}{daly}{gain}"
    facts = {"rto_s": rto, "rto_components": values, "daly_s": advice["interval_s"] if advice else None,
             "goodput": advice.get("goodput") if advice else None}
    if spec.rto_budget is None:
        return PASS, figure, "no --rto-budget to hold it to", facts
    verdict = budget_verdict(values, spec.rto_budget)
    if verdict.ok:
        return PASS, figure, f"RTO within --rto-budget {format_duration(spec.rto_budget)}", facts
    return FAIL, figure, (f"RTO over --rto-budget {format_duration(spec.rto_budget)}; the largest part is {verdict.largest} "
                          f"({format_duration(verdict.largest_s)}): {CUT[verdict.largest]}"), facts


# --- 6 precision --------------------------------------------------------------------------


def precision(run_dir: Path) -> Check:
    """The mode ``auto`` (or the flag) chose and why, and what one step's op classes really ran in."""
    path = run_dir / PRECISION_REPORT
    if not path.exists():
        return Check("precision", SKIPPED, "-", NEEDS_RUNTIME if plain(run_dir) else f"{path.name} was not written")
    document = json.loads(path.read_text())
    classes = document["classes"]
    dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(document["mode"], "float32")
    matmul = classes.get("matmul/linear", {}).get("outputs", {})
    loss = classes.get("loss", {}).get("outputs", {})
    figure = f"{document['mode']} on {document['device']}"
    facts = {"report": document}
    problems = ([f"matmuls ran in {', '.join(matmul)}, not {dtype}"] if matmul and dtype not in matmul else []) + \
               ([f"the loss ran in {', '.join(loss)}, not float32"] if loss and "float32" not in loss else [])
    if problems:
        return Check("precision", WARN, figure, "; ".join(problems), facts)
    return Check("precision", PASS, figure, f"{document['reason']}; matmuls in {dtype}, loss in float32 "
                 "(per op: `ckptrun precision-report`)", facts)
