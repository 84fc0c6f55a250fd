"""``ckptrun precision-report RUN_DIR``: which dtype each operator class really ran in.

Reads ``RUN_DIR/precision.json``, written by the runtime on rank 0 after the
first optimizer step of a run (see ``ckptrun.runtime.step.precision_report``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from ckptrun.cli.commands.which_run import chosen_run, run_dir_argument, run_dir_option
from ckptrun.cli.errors import EXIT_OK, CkptrunError, command

REPORT = "precision.json"


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{dtype}×{n}" for dtype, n in sorted(counts.items(), key=lambda kv: -kv[1])) or "-"


@command
def precision_report(
    run_dir: Optional[Path] = run_dir_argument(),
    run_dir_flag: Optional[Path] = run_dir_option(),
    as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON document."),
) -> int:
    """Show the input, output and accumulation precision per operator class, observed for one real step."""
    run_dir = chosen_run(run_dir, run_dir_flag)
    if not run_dir.is_dir():
        raise CkptrunError(f"{run_dir}: no such run directory", "pass the RUN_DIR that `ckptrun launch` printed (runs/NAME)")
    path = run_dir / REPORT
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        raise CkptrunError(f"{path} does not exist", hint="it is written after the first optimizer step of a run that uses ckptrun.runtime") from None
    except ValueError as exc:
        raise CkptrunError(f"{path} is not valid JSON ({exc})", hint="delete it; the next run writes it again") from None
    if as_json:
        typer.echo(json.dumps(document, indent=1, sort_keys=True))
        return EXIT_OK
    typer.echo(f"precision {document['mode']} on {document['device']}: {document['reason']}")
    typer.echo(f"parameters {', '.join(document['parameters'])}; optimizer state {', '.join(document['optimizer_state']) or '-'}")
    rows = [("class", "inputs", "outputs", "accumulation", "ops")]
    for name, row in document["classes"].items():
        rows.append((name, _counts(row["inputs"]), _counts(row["outputs"]), row["accumulation"], str(row["count"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        typer.echo("  ".join(cell.ljust(width) for cell, width in zip(r, widths)).rstrip())
    return EXIT_OK
