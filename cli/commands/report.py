"""``ckptrun report RUN_DIR``: a picture of the run, and an HTML page with it and the run's summary.

The PNG has three panels: loss over steps, one line per attempt, with each
failure, restart, stop and resume marked, snapshot ticks along the bottom and
the steps a later attempt replayed drawn over the originals (hollow markers:
an exact resume puts them on the line); throughput over wall time with the
recovery gaps shaded and the stops and resumes marked; and one stacked bar
per restart of its measured RTO components. A script without the runtime
logs no loss: its step records (the bootstrap's optimizer-step hook) still
draw throughput, failures and restarts.
The HTML page embeds the PNG (base64) and tables of the run, its restarts and
its replayed steps, so it is one self-contained file to attach or mail.

Everything is read from the run directory's records (contract C3) through
:mod:`ckptrun.runtime.records`. matplotlib is an optional extra
(``pip install 'ckptrun[report]'``) and is imported inside the command, with
the Agg canvas (no display needed). Importable without torch or matplotlib.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from ckptrun.cli.commands.report_data import RunFacts, summarize
from ckptrun.cli.commands.report_figure import draw
from ckptrun.cli.commands.report_page import html_page
from ckptrun.cli.commands.status_facts import check_run_dir
from ckptrun.cli.commands.which_run import chosen_run, run_dir_argument, run_dir_option
from ckptrun.cli.errors import EXIT_OK, CkptrunError, command


@command
def report(
    run_dir: Optional[Path] = run_dir_argument(),
    run_dir_flag: Optional[Path] = run_dir_option(),
    output: Optional[Path] = typer.Option(None, "--output", "-o", metavar="FILE.png", help="The PNG's path; the HTML page goes beside it (same stem). [default: RUN_DIR/report.png]", show_default=False),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document (the files and the summary) on stdout."),
) -> int:
    """Draw the run (loss with failures, restarts and replays; throughput; RTO per restart) as PNG + HTML.

    \b
    Needs matplotlib: pip install 'ckptrun[report]'.
    Examples:
      ckptrun report runs/demo
      ckptrun report runs/demo -o demo.png      # also writes demo.html
    """
    run_dir = chosen_run(run_dir, run_dir_flag)
    check_run_dir(run_dir)
    png = output if output is not None else run_dir / "report.png"
    if png.suffix.lower() != ".png":
        raise CkptrunError(f"-o {png}: the picture is a PNG", "name the file FILE.png (the HTML page becomes FILE.html)")
    figure_module = _matplotlib()
    facts = RunFacts.read(run_dir)
    if not facts.series:
        raise CkptrunError(f"{run_dir} has no step records yet (metrics.jsonl is empty)", "report once the run has trained a step")
    summary = summarize(facts)
    png.parent.mkdir(parents=True, exist_ok=True)
    draw(facts, figure_module, png)
    page = png.with_suffix(".html")
    page.write_text(html_page(summary, png.read_bytes()))
    if as_json:
        sys.stdout.write(json.dumps({"png": str(png), "html": str(page), "summary": summary}, indent=2) + "\n")
    else:
        sys.stdout.write(f"{png}\n{page}\n")
    return EXIT_OK


def _matplotlib() -> Any:
    try:
        from matplotlib import figure
    except ImportError:
        raise CkptrunError("ckptrun report draws with matplotlib, which is not installed",
                           "pip install 'ckptrun[report]'") from None
    return figure

