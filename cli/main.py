"""The ``ckptrun`` command line: the typer app, global options, and the command list.

Each command lives in its own module as a plain function decorated with
:func:`ckptrun.cli.errors.command`; registering one is a single
``app.command()(fn)`` line at the bottom of this file. Import hygiene matters
here: ``ckptrun --help`` and ``ckptrun verify`` must not import torch, so
command modules import heavy things inside the function that needs them.
"""

from __future__ import annotations

import typer

from ckptrun.cli import errors
from ckptrun.cli.estimate_rto import estimate_rto
from ckptrun.cli.demo import demo
from ckptrun.cli.launch import LAUNCH_CONTEXT, launch, resume, stop
from ckptrun.cli.precision_report import precision_report
from ckptrun.cli.verify import verify
from ckptrun.cli.status import status
from ckptrun.cli.init import init
from ckptrun.cli.export import export
from ckptrun.cli.report import report

EPILOG = "\b\nExit codes (the same for every command):\n" + errors.exit_codes_help()

app = typer.Typer(
    name="ckptrun",
    epilog=EPILOG,
    no_args_is_help=True,
    add_completion=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"ckptrun {version('ckptrun')}")
        raise typer.Exit()


@app.callback()
def root(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors too."),
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Launch PyTorch training with verified atomic snapshots, restart it on failure, measure recovery."""
    errors.set_debug(debug)


# --- commands: one line each (each module keeps heavy imports inside its command) ---

app.command(epilog=EPILOG, context_settings=LAUNCH_CONTEXT, options_metavar="[OPTIONS] [SCRIPT [ARGS]...]")(launch)
app.command(epilog=EPILOG)(resume)
app.command(epilog=EPILOG)(stop)
app.command(epilog=EPILOG)(demo)
app.command(epilog=EPILOG)(verify)
app.command(epilog=EPILOG)(estimate_rto)
app.command("precision-report", epilog=EPILOG)(precision_report)
app.command(epilog=EPILOG)(status)
app.command(epilog=EPILOG)(init)
app.command(epilog=EPILOG)(export)
app.command(epilog=EPILOG)(report)


def main() -> None:
    """Console-script entry point (``ckptrun = ckptrun.cli.main:main``)."""
    app(prog_name="ckptrun")


if __name__ == "__main__":
    main()
