"""Which run a command means: the one named (``RUN_DIR`` or ``--run-dir``, either), else the newest.

"Newest" is by the run's own start (``run.json``'s ``created``), never by a directory's mtime: reading a
run (``report`` writes beside it) must not make it the default of the next bare ``resume --latest``.
When the default is used the choice is said on stderr, so a person sees which run a command acts on.
Importable without torch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from ckptrun.cli.errors import CkptrunError
from ckptrun.cli.supervision.rundir import RUNS_ROOT, latest_run

RUN_DIR_HELP = "The run. [default: the newest under runs/, by its start time]"
RUN_DIR_OPTION_HELP = "The same as RUN_DIR."


def run_dir_argument() -> object:
    return typer.Argument(None, metavar="RUN_DIR", help=RUN_DIR_HELP, show_default=False)


def run_dir_option() -> object:
    return typer.Option(None, "--run-dir", help=RUN_DIR_OPTION_HELP, show_default=False)


def chosen_run(positional: Path | None, option: Path | None, pass_as: str = "--run-dir RUN_DIR") -> Path:
    """The run named either way (both: they must agree), else the newest under runs/, announced."""
    if positional is not None and option is not None and positional.resolve() != option.resolve():
        raise CkptrunError(f"two runs: {positional} and --run-dir {option}", "pass one of them")
    named = positional if positional is not None else option
    if named is not None:
        return named
    run = latest_run(RUNS_ROOT, pass_as=pass_as)
    sys.stderr.write(f"ckptrun: run {run} (the newest under {RUNS_ROOT}/ by start time; pass {pass_as} for another)\n")
    return run


def positional_run_dir(extra: list[str], argv: list[str]) -> tuple[Path | None, list[str]]:
    """``resume [RUN_DIR] [-- ARGS]``: click hands ``resume`` its positional words and, after them, every word
    after the first ``--`` (the script's new arguments). One word before ``--`` is the run; two are refused."""
    after = argv[argv.index("--") + 1:] if "--" in argv else []
    named = extra[:len(extra) - len(after)]
    if len(named) > 1:
        raise CkptrunError(f"one run at a time: {' '.join(named)}",
                           "pass one RUN_DIR; the script's new arguments go after `--`")
    return (Path(named[0]) if named else None), extra[len(named):]
