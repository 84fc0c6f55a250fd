"""``ckptrun demo``: see a crash recovered exactly, with measured recovery time, in about half a minute.

Runs the embedded default job on 2 CPU ranks twice with ``ckptrun launch``:
an uninterrupted reference, then the same run with rank 1 SIGKILLed after
step 17. The second run restarts from the newest verified snapshot; the
summary shows the restart, the snapshot used, each RTO component (from
``events.jsonl``) and whether every per-step loss equals the reference's
bitwise. Exit 0 when it recovered exactly, 1 otherwise. Importable without torch.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import typer

from ckptrun.cli.errors import EXIT_NO, EXIT_OK, CkptrunError, command
from ckptrun.cli.supervision.recovery import STARTUP_PARTS
from ckptrun.cli.supervision.rundir import RUNS_ROOT
from ckptrun.runtime.records import final_losses, read_events, same_float

FAULT = "kill:rank=1:step=17"
COMMON = ["--nproc-per-node", "2", "--save-every-steps", "5", "--restart-backoff", "0.5"]
RTO_PARTS = ("detect_s", "teardown_s", "verify_s", "backoff_s", "relaunch_to_first_step_s")
RELAUNCH_PARTS = ("startup_s", "restore_s", "first_step_s")


def _launch(run_dir: Path, *extra: str) -> int:
    if run_dir.exists():
        shutil.rmtree(run_dir)  # the demo's own output from an earlier demo
    command = [sys.executable, "-m", "ckptrun.cli.main", "launch", *COMMON, "--run-dir", str(run_dir), *extra]
    return subprocess.run(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL).returncode


def summarize(reference_dir: Path, run_dir: Path) -> dict[str, Any]:
    """The demo's verdict from the two runs' records."""
    reference, losses = final_losses(reference_dir), final_losses(run_dir)
    restarts = read_events(run_dir, "restart")
    failures = read_events(run_dir, "failure")
    same = sorted(reference) == sorted(losses) and all(same_float(losses[s], reference[s]) for s in reference)
    return {"restarts": len(restarts), "failure": failures[0] if failures else None,
            "restart": restarts[0] if restarts else None, "steps_compared": len(reference),
            "losses_match_bitwise": bool(reference) and same, "reference_run": str(reference_dir), "run": str(run_dir)}


def _seconds(value: Any) -> str:
    return "n/a" if value is None else f"{value:.2f}s"


def render(summary: dict[str, Any]) -> str:
    restart, failure = summary["restart"] or {}, summary["failure"] or {}
    lines = [
        "",
        "ckptrun demo: the default job on 2 CPU ranks, rank 1 killed (SIGKILL) after step 17",
        f"  failure detected : {failure.get('cause', 'none')} of rank {failure.get('rank')} "
        f"({failure.get('signal') or failure.get('exit_code')}) at step {failure.get('step')}",
        f"  restarts         : {summary['restarts']}",
        f"  snapshot used    : step {restart.get('snapshot_step')} (manifest and sizes checked before relaunch, every byte verified as loaded), "
        f"{restart.get('lost_steps')} steps redone",
        "  recovery (RTO)   : " + ", ".join(f"{p[:-2]} {_seconds(restart.get(p))}" for p in RTO_PARTS),
        "    relaunch parts : " + ", ".join(f"{p[:-2]} {_seconds(restart.get(p))}" for p in RELAUNCH_PARTS),
        "    startup parts  : " + ", ".join(f"{p[:-2]} {_seconds(restart[p])}" for _, p in STARTUP_PARTS if p in restart),
        f"    total          : {_seconds(restart.get('rto_s'))}",
        f"  final losses     : {'identical, bit for bit, to' if summary['losses_match_bitwise'] else 'DIFFERENT from'} "
        f"the uninterrupted run ({summary['steps_compared']} steps)",
        f"  records          : {summary['run']}/events.jsonl, metrics.jsonl, logs/",
    ]
    return "\n".join(lines)


@command
def demo(
    runs: Path = typer.Option(RUNS_ROOT, "--runs", help="Where the demo's two run directories go (replaced each time)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as one JSON document."),
) -> int:
    """Run the default job twice (uninterrupted, then with a crash) and show recovery time and exactness."""
    reference_dir, run_dir = runs / "demo-reference", runs / "demo"
    print("ckptrun demo 1/2: reference run (no fault)", file=sys.stderr, flush=True)
    if _launch(reference_dir, "--name", "demo-reference") != 0:
        raise CkptrunError("the demo's reference run failed", f"see {reference_dir}/logs", EXIT_NO)
    print(f"ckptrun demo 2/2: the same run with --inject-fault {FAULT}", file=sys.stderr, flush=True)
    code = _launch(run_dir, "--name", "demo", "--inject-fault", FAULT)
    summary = summarize(reference_dir, run_dir)
    print(json.dumps(summary, default=str) if as_json else render(summary))
    if code != 0 or not summary["losses_match_bitwise"] or summary["restarts"] != 1:
        raise CkptrunError(f"the demo did not recover exactly (launch exit {code})", f"see {run_dir}/logs", EXIT_NO)
    return EXIT_OK
