"""``ckptrun estimate-rto PATH``: how long recovery from a failure takes, and what a failure costs.

RTO = detect + teardown + verify + backoff + restart: from the moment a rank
dies to the first optimizer step after the restore. The expected cost of a
failure adds the work redone: RTO + (τ + δ)/2 + w. Each component comes with
its source (this run's history, measured now, estimated from measurements,
configured, or assumed — naming the assumption); see
:mod:`ckptrun.cli.recovery_budget.rto_components`. With ``--mtbf`` the report adds goodput and
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
from typing import Any, Optional

import typer

from ckptrun.cli.durations import DurationError, format_duration, parse_duration
from ckptrun.cli.commands.store_flag import storage_option_flag
from ckptrun.cli.errors import EXIT_NO, EXIT_OK, CkptrunError, command
from ckptrun.cli.humanize import human_bytes
from ckptrun.cli.recovery_budget import rto_components, rto_history, rto_scale
from ckptrun.cli.recovery_budget.estimate import build_report, check_budget, find_target
from ckptrun.cli.supervision.recovery import CUT


@command
def estimate_rto(
    path: str = typer.Argument(..., metavar="PATH", help="Run directory, checkpoint directory or object-store URL (s3://…)."),
    mtbf: str | None = typer.Option(None, "--mtbf", metavar="DURATION", help="Mean time between failures of the job (e.g. 3h): adds goodput and the recommended save interval."),
    budget: str | None = typer.Option(None, "--budget", metavar="DURATION", help="Exit 1 when the RTO exceeds this (e.g. 90s), naming the part to cut."),
    budget_includes_lost_work: bool = typer.Option(False, "--budget-includes-lost-work", help="Compare the cost per failure (RTO + lost work) with --budget instead."),
    probe: bool = typer.Option(False, "--probe", help="Measure the restart for real: the run's script restores the newest snapshot and stops (a bare checkpoint dir: load it, no user code)."),
    nproc_per_node: int | None = typer.Option(None, "--nproc-per-node", min=1, metavar="N", help="World size for probes and the no-op launch. [default: the snapshot's]"),
    nodes: int | None = typer.Option(None, "--nodes", min=1, metavar="N", help="Also project the budget to N nodes (each part marked measured or modelled)."),
    gpus_per_node: int = typer.Option(8, "--gpus-per-node", min=1, metavar="G", help="With --nodes: ranks per node."),
    state_bytes: str | None = typer.Option(None, "--state-bytes", metavar="SIZE", help="With --nodes: the job's whole training state, e.g. 1.1T or 500GB. [default: this snapshot's]", show_default=False),
    mtbf_per_node: str | None = typer.Option(None, "--mtbf-per-node", metavar="DURATION", help="With --nodes: one node's mean time between failures (the job's is this ÷ N), for Daly's interval and goodput there."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document on stdout instead of a table."),
    storage_option: Optional[list[str]] = storage_option_flag(),
) -> int:
    """Estimate the recovery time (RTO) of a run and the cost of a failure, each part with its source.

    \b
    Durations: 1ms, 90s, 5m, 3h, 2d, 1h30m, or bare seconds.
    Examples:
      ckptrun estimate-rto runs/demo
      ckptrun estimate-rto runs/demo --mtbf 6h --budget 2m
      ckptrun estimate-rto runs/demo/checkpoints --probe --json
      ckptrun estimate-rto runs/demo --nodes 1024 --gpus-per-node 8 --state-bytes 1.1T --mtbf-per-node 1000d
    """
    mtbf_s, budget_s = _duration("--mtbf", mtbf), _duration("--budget", budget)
    if budget_includes_lost_work and budget_s is None:
        raise CkptrunError("--budget-includes-lost-work needs --budget", "add --budget DURATION (e.g. --budget 5m)")
    scale = _scale_options(nodes, state_bytes, mtbf_per_node)
    target = find_target(path, storage_option)
    world = nproc_per_node or target.manifest.world_size  # another than the snapshot's: the probe reshards
    document = build_report(target, probe, world, mtbf_s)
    if nodes is not None:
        _, _, restore = rto_components.restore_estimate(target, world)
        if document["components"]["restart"]["source"] == "history":  # the restore inside the restart figure
            restore["restore_s"] = rto_history.restart_figure(target.restarts, "restore_s")[0] or restore["restore_s"]
        size = scale["state_bytes"] if scale["state_bytes"] is not None else target.manifest.total_bytes
        document["projection"] = rto_scale.project(document, restore, nodes, gpus_per_node, size, scale["mtbf_per_node_s"],
                                                   rto_scale.store_round_trip_s())
    verdict = check_budget(document, budget_s, budget_includes_lost_work)
    if as_json:
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
    else:
        print_report(document)
    if verdict is not None and not verdict["ok"]:
        raise CkptrunError(verdict["message"], CUT[verdict["largest"]], EXIT_NO)
    return EXIT_OK


def _scale_options(nodes: int | None, state_bytes: str | None, mtbf_per_node: str | None) -> dict[str, Any]:
    """--state-bytes and --mtbf-per-node parsed (they need --nodes)."""
    if nodes is None and (state_bytes is not None or mtbf_per_node is not None):
        raise CkptrunError("--state-bytes and --mtbf-per-node project to another size: they need --nodes",
                           "add --nodes N (e.g. --nodes 1024)")
    size = None
    if state_bytes is not None:
        try:
            size = rto_scale.parse_size(state_bytes)
        except ValueError as exc:
            raise CkptrunError(f"--state-bytes {exc}", "for example --state-bytes 1.1T") from None
        if size <= 0:
            raise CkptrunError(f"--state-bytes {state_bytes!r} must be more than zero", "for example --state-bytes 1.1T")
    return {"state_bytes": size, "mtbf_per_node_s": _duration("--mtbf-per-node", mtbf_per_node)}


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


# --- text output ------------------------------------------------------------------------


def print_report(document: dict[str, Any]) -> None:
    snap = document["snapshot"]
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
    if document.get("node_loss"):  # many nodes: a lost node is detected by its silence, then waited for
        join = document["node_loss"]["join"]
        out.insert(-1, f"after a lost node: {_seconds(totals['rto_node_loss_s'])} s (node timeout "
                       f"{_seconds(document['node_loss']['detect_s'])} s + rejoin {_seconds(join['value_s'])} s: {join['detail']})")
    out += _mtbf_lines(document)
    if document.get("projection"):
        out += rto_scale.text_lines(document["projection"])
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
