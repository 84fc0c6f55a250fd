"""The ``ckptrun`` command line: the typer app, global options, and the command list.

Each command lives in its own module as a plain function decorated with
:func:`ckptrun.cli.errors.command`; registering one is a single entry of
:class:`Commands`, which imports the module only when that command runs
(``ckptrun --help`` imports none of them). Import hygiene matters here too:
``ckptrun verify`` must not import torch, so command modules import heavy
things inside the function that needs them.
"""

from __future__ import annotations

import sys

import typer
from typer._click.exceptions import ClickException, NoArgsIsHelpError, NoSuchOption, UsageError  # typer vendors click

from ckptrun.cli import errors
from ckptrun.cli.lazy_commands import LazyCommand, LazyGroup

EPILOG = "\b\nExit codes (the same for every command):\n" + errors.exit_codes_help()
SCRIPT_USAGE = "[OPTIONS] [SCRIPT [ARGS]...]"


class Commands(LazyGroup):
    """The command list: name -> module, function, help row; a module is imported only when its command runs."""

    table = {
        "launch": LazyCommand("ckptrun.cli.commands.launch", "launch", "Launch SCRIPT [ARGS...] with torchrun under supervision: "
                              "restart from the newest verified snapshot on a crash or hang.",
                              context="ckptrun.cli.commands.launch:LAUNCH_CONTEXT", metavar=SCRIPT_USAGE),
        "resume": LazyCommand("ckptrun.cli.commands.launch", "resume", "Continue a stopped, failed or preempted run from its "
                              "newest verified snapshot, with its run.json spec.",
                              context="ckptrun.cli.commands.launch:RESUME_CONTEXT", metavar="[OPTIONS] [RUN_DIR] [-- SCRIPT_ARGS...]"),
        "stop": LazyCommand("ckptrun.cli.commands.launch", "stop", "Ask a running launch to save a snapshot at the next step "
                            "boundary and exit 3 (resumable)."),
        "preflight": LazyCommand("ckptrun.cli.commands.preflight", "preflight", "Before a long run: prove SCRIPT learns, "
                                 "resumes exactly and fits its budgets, with launch's options.",
                                 context="ckptrun.cli.commands.launch:LAUNCH_CONTEXT", metavar=SCRIPT_USAGE),
        "demo": LazyCommand("ckptrun.cli.commands.demo", "demo", "Run the default job twice (uninterrupted, then with a crash) "
                            "and show recovery time and exactness."),
        "verify": LazyCommand("ckptrun.cli.commands.verify", "verify", "Check every snapshot's bytes against its manifest "
                              "(exit 1 if any is corrupt or incomplete)."),
        "estimate-rto": LazyCommand("ckptrun.cli.commands.estimate_rto", "estimate_rto", "Estimate the recovery time (RTO) of "
                                    "a run and the cost of a failure, each part with its source."),
        "precision-report": LazyCommand("ckptrun.cli.commands.precision_report", "precision_report", "Show the input, output "
                                        "and accumulation precision per operator class, observed for one real step."),
        "status": LazyCommand("ckptrun.cli.commands.status", "status", "Show a run: attempt and restarts, each rank's "
                              "heartbeat, the last snapshot, progress, ETA and RTO."),
        "init": LazyCommand("ckptrun.cli.commands.init", "init", "Copy a training script template and a commented "
                            "ckptrun.toml into DIR, then print the next commands."),
        "export": LazyCommand("ckptrun.cli.commands.export", "export", "Write the model (or EMA) weights of a verified "
                              "snapshot as a plain state_dict file (.pt or .safetensors), or a Hugging Face or DCP "
                              "directory (--format)."),
        "report": LazyCommand("ckptrun.cli.commands.report", "report", "Draw the run (loss with failures, restarts and "
                              "replays; throughput; RTO per restart) as PNG + HTML."),
    }


app = typer.Typer(
    name="ckptrun",
    cls=Commands,
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


def main() -> None:
    """Console-script entry point (``ckptrun = ckptrun.cli.main:main``).

    Every parse error of every command (an unknown command or option, a bad value, a missing argument)
    is a refusal in the ``error:``/``hint:`` form every other refusal has, exit 2, before anything runs:
    click's own "Usage / Try / Error" block never shows; its did-you-mean moves into the hint.
    """
    try:
        code = app(prog_name="ckptrun", standalone_mode=False)
    except NoArgsIsHelpError as exc:
        exc.show()  # a bare `ckptrun` / `ckptrun CMD` without its arguments: the help is the answer
        code = exc.exit_code
    except UsageError as exc:
        code = errors.report_error(unknown_option(exc) if isinstance(exc, NoSuchOption) else usage_error(exc))
    except ClickException as exc:
        code = errors.report_error(errors.CkptrunError(exc.format_message(), None, exc.exit_code))
    except typer.Abort:
        typer.echo("Aborted!", err=True)
        code = errors.EXIT_NO
    raise SystemExit(code or errors.EXIT_OK)


def usage_error(exc: UsageError) -> errors.CkptrunError:
    """click's message as the error, its did-you-mean (typer's, difflib over the names) as the hint."""
    command = exc.ctx.command_path if exc.ctx else command_named_in(sys.argv[1:])
    message, _, guess = exc.format_message().partition(" Did you mean ")
    hint = f"did you mean {guess} " if guess else ""
    return errors.CkptrunError(message, f"{hint}see `{command} --help`", errors.EXIT_REFUSED)


def command_named_in(argv: list[str]) -> str:
    """``ckptrun CMD`` for the first word of ``argv`` that is a command (click's parser errors carry no
    context), else ``ckptrun``."""
    name = next((word for word in argv if not word.startswith("-")), None)
    return f"ckptrun {name}" if name in Commands.table else "ckptrun"


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
