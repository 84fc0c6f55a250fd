"""The recovery estimate ``ckptrun estimate-rto`` reports: find what PATH holds, gather every component,
add the totals, goodput, the recommended interval and the budget verdict, as one JSON-ready document.

RTO = detect + teardown + verify + backoff + restart: from the moment a rank
dies to the first optimizer step after the restore. The expected cost of a
failure adds the work redone: RTO + (τ + δ)/2 + w. Each component comes with
its source (:mod:`ckptrun.cli.recovery_budget.rto_components`). The command
(:mod:`ckptrun.cli.commands.estimate_rto`) parses options and prints; the
in-launch estimate (:mod:`ckptrun.cli.recovery_budget.rto_launch`) uses
:func:`find_target` too. Importable without torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckptrun.cli import store_location
from ckptrun.cli.durations import format_duration
from ckptrun.cli.errors import CkptrunError
from ckptrun.cli.recovery_budget import rto_components as parts
from ckptrun.cli.recovery_budget import rto_nodes
from ckptrun.cli.recovery_budget.rto_measure import noop_attempt
from ckptrun.cli.recovery_budget.rto_model import RTO_PARTS, Component, budget_verdict, cost_per_failure, daly, goodput, total, young
from ckptrun.cli.supervision.spec import read_run_record
from ckptrun.runtime import records
from ckptrun.runtime.storage.ckpt_url import StoreUrl
from ckptrun.runtime.manifest import MANIFEST_NAME, ManifestError, read_manifest
from ckptrun.runtime.storage.store import LINEAGE_NAME, LineageError, current_lineage, list_entries

PATH_HINT = "pass a run directory (it has events.jsonl or checkpoints/) or a checkpoint directory with step-NNNNNNNNN snapshots"

# --- what PATH is ---------------------------------------------------------------------


def find_target(given: Path | str, storage_option: list[str] | None = None) -> parts.Target:
    """A run directory (records, maybe run.json), a checkpoint directory or an object-store URL, and the
    snapshot a restart would use; ``storage_option`` as ``launch`` takes them (over a run's stored ones)."""
    where = store_location.location(given)
    if isinstance(where, StoreUrl):
        return _store_target(where.url, "checkpoint", store_location.store_at(where, storage_option), None)
    given_options = store_location.given_options(storage_option)
    path = where.absolute()
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
        remote = store_location.store_of(spec, run_id, given_options)  # this run's snapshots only, on a shared prefix
        target = (_store_target(path, "run", remote, spec.local_cache_dir, run_dir=path, spec=spec, run_id=run_id) if remote
                  else _target(path, "run", ckpt_dir, run_dir=path, spec=spec, run_id=run_id))
        target.events, target.metrics = records.read_events(path), records.read_metrics(path)
        return target
    raise CkptrunError(f"{path} is neither a run directory nor a checkpoint directory", PATH_HINT)


def _is_ckpt_dir(path: Path) -> bool:
    return (path / LINEAGE_NAME).is_file() or any(e.kind == "published" for e in list_entries(path))


def _run_record(run_dir: Path) -> tuple[Any, str | None]:
    if not (run_dir / "run.json").exists():
        return None, None
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


def _store_target(path: Path | str, kind: str, remote: Any, cache: Path | None, **fields: Any) -> parts.Target:
    """The restore a restart would do from an object store, done and timed now (its verify component):
    the verified local copy, or the newest committed prefix downloaded with every object hashed."""
    choice = store_location.fetch_newest(remote, cache, parts.say)
    target = _target(path, kind, choice.path.parent, snapshot=choice.path, **fields)  # type: ignore[arg-type]
    target.created = [(p.step, p.manifest.created) for p in remote.line()]
    target.older, target.fetched, target.store = [], choice, remote
    return target


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
    lost_node = rto_nodes.node_loss(target, lambda: _fresh_launch(target, world))
    return {
        "path": str(target.path), "kind": target.kind, "run_id": target.run_id,
        "snapshot": {"path": str(target.snapshot), "step": target.manifest.step, "bytes": target.manifest.total_bytes,
                     "files": len(target.manifest.files), "world_size": target.manifest.world_size},
        "components": {name: component.to_json() for name, component in components.items()},
        "node_loss": lost_node,
        "totals": {"rto_s": rto, "rto_hang_s": None if rto is None else rto - components["detect"].value_s + hang,
                   "rto_node_loss_s": None if rto is None or lost_node is None else
                   rto - components["detect"].value_s + lost_node["detect_s"] + lost_node["join"]["value_s"]
                   + ((lost_node["restart"]["value_s"] - components["restart"].value_s) if lost_node["restart"] else 0.0),
                   "cost_per_failure_s": cost},
        "mtbf_s": mtbf_s,
        "goodput": goodput(tau, delta, w, rto, mtbf_s) if mtbf_s and cost is not None else None,
        "recommendation": _recommend(pace, rto, mtbf_s),
    }


def gather(target: parts.Target, probe: bool, world: int) -> dict[str, Component]:
    """The RTO components; one no-op launch is made only where history lacks teardown or restart."""
    checked = rto_nodes.spread_verify(target, parts.verify(target))  # first: a fallback changes the snapshot
    needs_noop = hist_missing(target, "teardown_s") or (hist_missing(target, "relaunch_to_first_step_s") and not probe)
    noop = None
    if needs_noop:
        path, _ = parts.relaunch_path(target)
        ranks = rto_nodes.ranks_per_node(target, world)
        parts.say(f"timing a no-op {ranks}-rank relaunch ({path.words}) and its teardown")
        noop = noop_attempt(ranks, target.spec, store=target.store)
    return {
        "detect": parts.detect(target),
        "teardown": parts.teardown(target, noop),
        "verify": checked,
        "backoff": parts.backoff(target),
        "restart": parts.restart(target, probe, world, noop),
    }


def _fresh_launch(target: parts.Target, world: int) -> float:
    """A no-op relaunch of one node's ranks through a fresh agent (no standby): a promoted spare's first attempt."""
    spec = target.spec.model_copy(update={"standby": False}) if target.spec is not None else None
    ranks = rto_nodes.ranks_per_node(target, world)
    parts.say(f"timing a no-op {ranks}-rank launch through a fresh agent (a spare's first attempt)")
    return noop_attempt(ranks, spec, store=target.store).launch_s


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


def check_budget(document: dict[str, Any], limit_s: float | None, with_lost_work: bool) -> dict[str, Any] | None:
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
