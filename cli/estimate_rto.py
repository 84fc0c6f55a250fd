"""``ckptrun estimate-rto PATH``: how long recovery from a failure takes, and what a failure costs.

RTO = detect + teardown + verify + backoff + restart: from the moment a rank
dies to the first optimizer step after the restore. The expected cost of a
failure adds the work redone: RTO + (τ + δ)/2 + w. Each component comes with
its source (this run's history, measured now, estimated from measurements,
configured, or assumed — naming the assumption); see
:mod:`ckptrun.cli.rto_components`. With ``--mtbf`` the report adds goodput and
the checkpoint interval Daly's formula recommends (Young's beside it); with
``--budget`` the exit code says whether the RTO (or, with
``--budget-includes-lost-work``, the cost per failure) fits, naming the part
to cut when it does not. The job need not be running; the real run's records
and snapshots are only read. torch is imported only by ``--probe``'s child
processes and the no-op launch. Exit 0 within budget (or no budget), 1 over
budget or when a probe shows the restore fails, 2 when PATH holds nothing to
estimate.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer

from ckptrun.cli import rto_components as parts
from ckptrun.cli.durations import DurationError, format_duration, parse_duration
from ckptrun.cli.errors import EXIT_NO, EXIT_OK, CkptrunError, command
from ckptrun.cli.rto_model import RTO_PARTS, Component, budget_verdict, cost_per_failure, daly, goodput, total, young
from ckptrun.runtime import records
from ckptrun.runtime.manifest import MANIFEST_NAME, ManifestError, read_manifest
from ckptrun.runtime.store import LINEAGE_NAME, LineageError, current_lineage, list_entries

PATH_HINT = "pass a run directory (it has events.jsonl or checkpoints/) or a checkpoint directory with step-NNNNNNNNN snapshots"
CUT = {
    "detect": "a crash is found within one poll; for hangs lower --heartbeat-timeout",
    "teardown": "ranks should exit promptly on SIGTERM; a lower --grace-period bounds the wait",
    "verify": "verification reads and hashes every byte: blake3 (hash_algorithm = \"blake3\" in --config) hashes faster, smaller snapshots help",
    "backoff": "lower --restart-backoff",
    "restart": "start-up and restore dominate: smaller snapshots, faster storage, fewer imports and less set-up before training",
    "lost_work": "save more often (--save-every-seconds; with --mtbf the report recommends an interval)",
}


@command
def estimate_rto(
    path: Path = typer.Argument(..., metavar="PATH", help="Run directory or checkpoint directory."),
    mtbf: str | None = typer.Option(None, "--mtbf", metavar="DURATION", help="Mean time between failures of the job (e.g. 3h): adds goodput and the recommended save interval."),
    budget: str | None = typer.Option(None, "--budget", metavar="DURATION", help="Exit 1 when the RTO exceeds this (e.g. 90s), naming the part to cut."),
    budget_includes_lost_work: bool = typer.Option(False, "--budget-includes-lost-work", help="Compare the cost per failure (RTO + lost work) with --budget instead."),
    probe: bool = typer.Option(False, "--probe", help="Measure the restart for real: the run's script restores the newest snapshot and stops (a bare checkpoint dir: load it, no user code)."),
    nproc_per_node: int | None = typer.Option(None, "--nproc-per-node", min=1, metavar="N", help="World size for probes and the no-op launch. [default: the snapshot's]"),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document on stdout instead of a table."),
) -> int:
    """Estimate the recovery time (RTO) of a run and the cost of a failure, each part with its source.

    \b
    Durations: 1ms, 90s, 5m, 3h, 2d, 1h30m, or bare seconds.
    Examples:
      ckptrun estimate-rto runs/demo
      ckptrun estimate-rto runs/demo --mtbf 6h --budget 2m
      ckptrun estimate-rto runs/demo/checkpoints --probe --json
    """
    mtbf_s, budget_s = _duration("--mtbf", mtbf), _duration("--budget", budget)
    if budget_includes_lost_work and budget_s is None:
        raise CkptrunError("--budget-includes-lost-work needs --budget", "add --budget DURATION (e.g. --budget 5m)")
    target = find_target(path)
    world = nproc_per_node or target.manifest.world_size  # another than the snapshot's: the probe reshards
    document = build_report(target, probe, world, mtbf_s)
    verdict = _budget(document, budget_s, budget_includes_lost_work)
    if as_json:
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
    else:
        print_report(document)
    if verdict is not None and not verdict["ok"]:
        raise CkptrunError(verdict["message"], CUT[verdict["largest"]], EXIT_NO)
    return EXIT_OK


def _duration(flag: str, text: str | None) -> float | None:
    if text is None:
        return None
    try:
        seconds = parse_duration(text)
    except DurationError as exc:
        raise CkptrunError(f"{flag} {exc}", f"for example {flag} 90s, 5m or 3h") from None
    if seconds <= 0:
        raise CkptrunError(f"{flag} {text!r} must be longer than zero", f"for example {flag} 90s, 5m or 3h")
    return seconds


# --- what PATH is ---------------------------------------------------------------------


def find_target(path: Path) -> parts.Target:
    """A run directory (records, maybe run.json) or a checkpoint directory, and the snapshot a restart would use."""
    path = path.absolute()
    if not path.is_dir():
        raise CkptrunError(f"{path}: no such directory", PATH_HINT)
    if (path / MANIFEST_NAME).is_file():
        return _target(path, "checkpoint", path.parent, snapshot=path)
    if _is_ckpt_dir(path):
        if (path.parent / records.EVENTS).exists():
            parts.say(f"note: {path.parent} is its run directory; pass it for the run's history")
        return _target(path, "checkpoint", path)
    if (path / records.EVENTS).exists() or (path / "run.json").exists() or (path / "checkpoints").is_dir():
        spec, run_id = _run_record(path)
        ckpt_dir = spec.ckpt_dir if spec is not None and spec.ckpt_dir is not None else path / "checkpoints"
        target = _target(path, "run", ckpt_dir, run_dir=path, spec=spec, run_id=run_id)
        target.events, target.metrics = records.read_events(path), records.read_metrics(path)
        return target
    raise CkptrunError(f"{path} is neither a run directory nor a checkpoint directory", PATH_HINT)


def _is_ckpt_dir(path: Path) -> bool:
    return (path / LINEAGE_NAME).is_file() or any(e.kind == "published" for e in list_entries(path))


def _run_record(run_dir: Path) -> tuple[Any, str | None]:
    if not (run_dir / "run.json").exists():
        return None, None
    from ckptrun.cli.spec import read_run_record

    record = read_run_record(run_dir)
    return record.spec, record.run_id


def _target(path: Path, kind: str, ckpt_dir: Path, snapshot: Path | None = None, **fields: Any) -> parts.Target:
    chain = _lineage_snapshots(ckpt_dir)
    if snapshot is None:
        if not chain:
            raise CkptrunError(f"{ckpt_dir} holds no published snapshot of the current lineage: a failure now "
                               "restarts from the beginning",
                               "estimate once the run has saved a snapshot (`ckptrun verify` lists them)")
        snapshot = chain[-1][0]
    try:
        manifest = read_manifest(snapshot)
    except ManifestError as exc:
        raise CkptrunError(str(exc), f"check it with `ckptrun verify {snapshot}`") from None
    created = [(m.step, m.created) for _, m in chain]
    older = [(p, m) for p, m in reversed(chain) if m.step < manifest.step]
    return parts.Target(path, kind, ckpt_dir, snapshot, manifest, created=created, older=older, **fields)


def _lineage_snapshots(ckpt_dir: Path) -> list[tuple[Path, Any]]:
    """Published snapshots of the current lineage with readable manifests, oldest first."""
    try:
        return [(entry.path, manifest) for entry, manifest in current_lineage(ckpt_dir)]
    except LineageError as exc:
        raise CkptrunError(str(exc), "restore lineage.json, or pass one snapshot directory") from None


# --- the report -------------------------------------------------------------------------


def build_report(target: parts.Target, probe: bool, world: int, mtbf_s: float | None) -> dict[str, Any]:
    """Every component, the totals and (with an MTBF) goodput and the recommended interval, as one document."""
    components = gather(target, probe, world)
    pace = parts.cadence(target)
    components["lost_work"] = parts.lost(target, pace)
    rto = total(components)
    tau, delta, w = pace.interval_s, pace.stall_s, pace.persist_s
    cost = cost_per_failure(rto, tau, delta, w) if rto is not None and tau is not None else None
    hang = components["detect"].facts["hang_s"]
    return {
        "path": str(target.path), "kind": target.kind, "run_id": target.run_id,
        "snapshot": {"path": str(target.snapshot), "step": target.manifest.step, "bytes": target.manifest.total_bytes,
                     "files": len(target.manifest.files), "world_size": target.manifest.world_size},
        "components": {name: component.to_json() for name, component in components.items()},
        "totals": {"rto_s": rto, "rto_hang_s": None if rto is None else rto - components["detect"].value_s + hang,
                   "cost_per_failure_s": cost},
        "mtbf_s": mtbf_s,
        "goodput": goodput(tau, delta, w, rto, mtbf_s) if mtbf_s and cost is not None else None,
        "recommendation": _recommend(pace, rto, mtbf_s),
    }


def gather(target: parts.Target, probe: bool, world: int) -> dict[str, Component]:
    """The RTO components; one no-op launch is made only where history lacks teardown or restart."""
    checked = parts.verify(target)  # first: a fallback changes the snapshot the rest is about
    needs_noop = hist_missing(target, "teardown_s") or (hist_missing(target, "relaunch_to_first_step_s") and not probe)
    noop = None
    if needs_noop:
        parts.say(f"timing a no-op {world}-rank launch and its teardown")
        from ckptrun.cli.rto_measure import noop_attempt

        noop = noop_attempt(world, target.spec)
    return {
        "detect": parts.detect(target),
        "teardown": parts.teardown(target, noop),
        "verify": checked,
        "backoff": parts.backoff(target),
        "restart": parts.restart(target, probe, world, noop),
    }


def hist_missing(target: parts.Target, key: str) -> bool:
    return not any(isinstance(r.get(key), (int, float)) for r in target.restarts)


def _recommend(pace: parts.Cadence, rto: float | None, mtbf_s: float | None) -> dict[str, Any] | None:
    if not mtbf_s or pace.stall_s <= 0:
        return None
    interval = daly(pace.stall_s, mtbf_s)
    return {
        "interval_s": interval, "young_s": young(pace.stall_s, mtbf_s), "stall_s": pace.stall_s,
        "interval_steps": interval / pace.step_s if pace.step_s else None,
        "goodput": goodput(interval, pace.stall_s, pace.persist_s, rto, mtbf_s) if rto is not None else None,
    }


def _budget(document: dict[str, Any], limit_s: float | None, with_lost_work: bool) -> dict[str, Any] | None:
    """Check the budget; the verdict goes into the document."""
    if limit_s is None:
        document["budget"] = None
        return None
    components = document["components"]
    figures = {name: components[name]["value_s"] for name in RTO_PARTS}
    if with_lost_work:
        cost, rto = document["totals"]["cost_per_failure_s"], document["totals"]["rto_s"]
        figures["lost_work"] = None if cost is None or rto is None else cost - rto
    unknown = [name for name, value in figures.items() if value is None]
    if unknown:
        raise CkptrunError(f"cannot check the budget: {unknown[0]} is unknown ({components[unknown[0]]['detail']})",
                           "drop --budget-includes-lost-work, or estimate once the run has saved twice")
    verdict = budget_verdict(figures, limit_s)
    what = "cost per failure" if with_lost_work else "RTO"
    largest = components[verdict.largest]
    message = (f"{what} {format_duration(verdict.figure_s)} exceeds the budget {format_duration(limit_s)}; the largest part "
               f"is {verdict.largest} ({format_duration(verdict.largest_s)}, {largest['source']})")
    document["budget"] = {"limit_s": limit_s, "includes_lost_work": with_lost_work, "figure_s": verdict.figure_s,
                          "ok": verdict.ok, "largest": verdict.largest, "largest_s": verdict.largest_s,
                          "message": None if verdict.ok else message}
    return document["budget"]


# --- text output ------------------------------------------------------------------------


def print_report(document: dict[str, Any]) -> None:
    snap = document["snapshot"]
    from ckptrun.cli.verify import human_bytes

    out = [f"{document['kind']} {document['path']}: snapshot step {snap['step']}, {human_bytes(snap['bytes'])}, "
           f"{snap['world_size']} rank(s)", ""]
    rows = [("COMPONENT", "SECONDS", "SOURCE", "DETAIL")]
    rows += [(name, _seconds(c["value_s"]), c["source"], c["detail"]) for name, c in document["components"].items()]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    out += [f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}".rstrip() for r in rows]
    totals = document["totals"]
    out += ["", f"RTO {_seconds(totals['rto_s'])} s = detect + teardown + verify + backoff + restart "
                f"(after a hang: {_seconds(totals['rto_hang_s'])} s)",
            f"cost per failure {_seconds(totals['cost_per_failure_s'])} s = RTO + (τ + δ)/2 + w"]
    out += _mtbf_lines(document)
    budget = document.get("budget")
    if budget:
        what = "cost per failure" if budget["includes_lost_work"] else "RTO"
        state = "within" if budget["ok"] else "OVER"
        out.append(f"budget {format_duration(budget['limit_s'])}: {what} {format_duration(budget['figure_s'])} is {state} "
                   f"budget (largest part: {budget['largest']})")
    sys.stdout.write("\n".join(out) + "\n")


def _mtbf_lines(document: dict[str, Any]) -> list[str]:
    mtbf = document["mtbf_s"]
    if not mtbf:
        return []
    lines = [f"with MTBF {format_duration(mtbf)}: goodput "
             + (f"{document['goodput']:.5f}" if document["goodput"] is not None else "unknown (save interval unknown)")]
    advice = document["recommendation"]
    if advice is None:
        return lines + ["recommended save interval: unknown (no save cost recorded)"]
    steps = f" ≈ {advice['interval_steps']:.0f} steps" if advice["interval_steps"] else ""
    gain = f", goodput there {advice['goodput']:.5f}" if advice["goodput"] is not None else ""
    return lines + [f"recommended save interval (Daly): {format_duration(advice['interval_s'])}{steps} "
                    f"(Young: {format_duration(advice['young_s'])}; δ {format_duration(advice['stall_s'])}){gain}"]


def _seconds(value: float | None) -> str:
    if value is None:
        return "?"
    return f"{value:.3f}" if value < 10 else f"{value:.1f}"
