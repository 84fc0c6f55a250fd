"""``ckptrun status [RUN_DIR]``: where a running or finished run stands, read from its run directory.

Everything comes from the records the supervisor and the ranks keep (contract
C3): ``run.json``, ``events.jsonl``, ``metrics.jsonl``, the heartbeat files,
the supervisor's holder file and the snapshot manifests; process liveness
from psutil. Nothing is written and nothing is hashed: the last snapshot gets
a size check only (``ckptrun verify`` hashes every byte), and the RTO figure
is the one past restarts measured (``ckptrun estimate-rto`` estimates one
without history). A straggler needs step rates, which need two looks at the
heartbeats: ``--watch`` keeps per-rank samples across refreshes; a single
read says ``n/a``. Importable without torch.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from ckptrun.cli.commands.status_facts import StepRates, check_run_dir, collect
from ckptrun.cli.commands.status_text import render
from ckptrun.cli.commands.which_run import chosen_run, run_dir_argument, run_dir_option
from ckptrun.cli.durations import DurationError, parse_duration
from ckptrun.cli.errors import EXIT_NO, EXIT_OK, CkptrunError, command

WATCH_INTERVAL_S = 2.0
CLEAR = "\033[H\033[2J"


@command
def status(
    run_dir: Optional[Path] = run_dir_argument(),
    run_dir_flag: Optional[Path] = run_dir_option(),
    watch: bool = typer.Option(False, "--watch", "-w", help="Refresh every 2 s in place (on a terminal; otherwise print once). Ctrl-C exits."),
    rto_budget: Optional[str] = typer.Option(None, "--rto-budget", metavar="DURATION", help="Compare the measured RTO with this (e.g. 90s); exit 1 when over."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document on stdout (--watch is ignored)."),
) -> int:
    """Show a run: attempt and restarts, each rank's heartbeat, the last snapshot, progress, ETA and RTO.

    \b
    A rank is flagged stale when its heartbeat is older than the run's
    --heartbeat-timeout (30 s without run.json), dead when its process is
    gone while the run goes on, and a straggler (with --watch) when its step
    rate over the last 60 s is below 0.8x the median rank's.
    Examples:
      ckptrun status
      ckptrun status runs/demo --watch
      ckptrun status runs/demo --json
    """
    run_dir = chosen_run(run_dir, run_dir_flag)
    check_run_dir(run_dir)
    budget = _budget(rto_budget)
    rates = StepRates()
    if watch and not as_json and sys.stdout.isatty():
        return _watch(run_dir, rates, budget)
    document = collect(run_dir, rates, budget)
    sys.stdout.write(json.dumps(document, indent=2) + "\n" if as_json else render(document) + "\n")
    unreachable = (document.get("snapshot") or {}).get("check") == "listing"  # the store cannot be listed: say so
    return EXIT_NO if document["rto"]["within_budget"] is False or unreachable else EXIT_OK


def _budget(text: str | None) -> float | None:
    try:
        return None if text is None else parse_duration(text)
    except DurationError as exc:
        raise CkptrunError(f"--rto-budget: {exc}", "pass a duration such as 90s or 5m") from None


def _watch(run_dir: Path, rates: StepRates, budget: float | None) -> int:
    """Redraw until Ctrl-C, which is how a person leaves a watch: exit 0."""
    try:
        while True:
            screen = render(collect(run_dir, rates, budget))
            sys.stdout.write(f"{CLEAR}{screen}\n\n(every {WATCH_INTERVAL_S:g} s; Ctrl-C to exit)\n")
            sys.stdout.flush()
            time.sleep(WATCH_INTERVAL_S)
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        return EXIT_OK

