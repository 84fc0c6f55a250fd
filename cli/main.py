"""The ``ckptrun`` command line: the typer app, global options, and the command list.

Each command lives in its own module as a plain function decorated with
:func:`ckptrun.cli.errors.command`; registering one is a single
``app.command()(fn)`` line at the bottom of this file. Import hygiene matters
here: ``ckptrun --help`` and ``ckptrun verify`` must not import torch, so
command modules import heavy things inside the function that needs them.
"""

from __future__ import annotations

import typer
from typer._click.exceptions import ClickException, NoSuchOption  # typer vendors click

from ckptrun.cli import errors
from ckptrun.cli.estimate_rto import estimate_rto
from ckptrun.cli.demo import demo
from ckptrun.cli.launch import LAUNCH_CONTEXT, RESUME_CONTEXT, launch, resume, stop
from ckptrun.cli.precision_report import precision_report
from ckptrun.cli.preflight import preflight
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
app.command(epilog=EPILOG, context_settings=RESUME_CONTEXT, options_metavar="[OPTIONS] [-- SCRIPT_ARGS...]")(resume)
app.command(epilog=EPILOG)(stop)
app.command(epilog=EPILOG, context_settings=LAUNCH_CONTEXT, options_metavar="[OPTIONS] [SCRIPT [ARGS]...]")(preflight)
app.command(epilog=EPILOG)(demo)
app.command(epilog=EPILOG)(verify)
app.command(epilog=EPILOG)(estimate_rto)
app.command("precision-report", epilog=EPILOG)(precision_report)
app.command(epilog=EPILOG)(status)
app.command(epilog=EPILOG)(init)
app.command(epilog=EPILOG)(export)
app.command(epilog=EPILOG)(report)


def main() -> None:
    """Console-script entry point (``ckptrun = ckptrun.cli.main:main``).

    click's own usage errors are shown as click shows them, except an unknown option, which gets the
    ``error:``/``hint:`` form every other refusal has (with click's did-you-mean, difflib over the
    command's options): a typo must read as a refusal, exit 2, before anything runs.
    """
    try:
        code = app(prog_name="ckptrun", standalone_mode=False)
    except NoSuchOption as exc:
        code = errors.report_error(unknown_option(exc))
    except ClickException as exc:
        exc.show()
        code = exc.exit_code
    except typer.Abort:
        typer.echo("Aborted!", err=True)
        code = errors.EXIT_NO
    raise SystemExit(code or errors.EXIT_OK)


def unknown_option(exc: NoSuchOption) -> errors.CkptrunError:
    """``error: No such option: --nproc-per-nod`` + ``hint: did you mean --nproc-per-node? ...``."""
    command = exc.ctx.command_path if exc.ctx else "ckptrun"
    possible = [p for p in exc.possibilities or () if p not in ("--help", "-h")]  # never a useful guess
    guess = f"did you mean {possible[0]}? " if possible else ""  # difflib's closest first
    where = "options go before SCRIPT; " if command.endswith((" launch", " preflight")) else ""
    if command.endswith(" resume"):
        where = f"new script args go after `--` (`{command} --latest -- {exc.option_name} ...`); "
    return errors.CkptrunError(exc.message, f"{guess}{where}see `{command} --help`", errors.EXIT_REFUSED)


if __name__ == "__main__":
    main()
