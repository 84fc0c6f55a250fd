"""Exit codes and the one place that turns an error into output and an exit code.

Every command is wrapped by :func:`command` (or calls :func:`run_command`), so a
person always sees the same thing when something goes wrong: ``error: <what
failed, where>`` and ``hint: <the fix>`` on stderr, no traceback unless
``--debug``. An exception that is not a :class:`CkptrunError` is a bug in
ckptrun: its traceback is printed, because it is ours, and the exit code is 101.

Exit codes, the same for every command:

    ====  ===============================================================
    code  meaning
    ====  ===============================================================
    0     done: the run completed, verify found everything intact, the
          estimate is within budget
    1     the answer is no: the run failed after its restart budget,
          verify found a bad snapshot, the RTO is over budget
    2     refused before anything ran: bad flag or config, missing file,
          busy run dir, a precision mode this hardware cannot run
    3     stopped and resumable: preempted, time limit, ``ckptrun stop``;
          ``ckptrun resume --latest`` continues
    4     failed in a way a restart cannot fix: failure before the first
          step, a config change refused on resume, anomaly stop, no
          progress across restarts
    5     requeue (many nodes): this node lost the job's leader; resumable
          like 3: the scheduler restarts the job, ``resume --latest`` continues
    101   a bug in ckptrun (the traceback is printed)
    ====  ===============================================================

Ctrl-C outside a command's own signal handling exits 130 (128 + SIGINT), the
shell convention. Output is plain text (no colour), so ``NO_COLOR`` is honoured.
"""

from __future__ import annotations

import functools
import sys
import traceback
from typing import Callable, TextIO, TypeVar

EXIT_OK = 0
EXIT_NO = 1
EXIT_REFUSED = 2
EXIT_STOPPED = 3
EXIT_UNRECOVERABLE = 4
EXIT_REQUEUE = 5
EXIT_BUG = 101
EXIT_INTERRUPTED = 130

EXIT_CODES: tuple[tuple[int, str], ...] = (
    (EXIT_OK, "done: run completed, snapshots intact, estimate within budget"),
    (EXIT_NO, "the answer is no: restart budget spent, bad snapshot, RTO over budget"),
    (EXIT_REFUSED, "refused before anything ran: bad flag or config, missing file, busy run"),
    (EXIT_STOPPED, "stopped and resumable: `ckptrun resume --latest` continues"),
    (EXIT_UNRECOVERABLE, "failed in a way a restart cannot fix (e.g. before the first step)"),
    (EXIT_REQUEUE, "requeue: this node lost the job's leader; resumable, the scheduler restarts the job"),
    (EXIT_BUG, "a bug in ckptrun (the traceback is printed)"),
)


class CkptrunError(Exception):
    """An error a person can act on: what failed, how to fix it, and the exit code.

    ``message`` names the thing that failed (and where); ``hint`` says the fix.
    Raise it anywhere under a command; :func:`run_command` renders it.
    """

    def __init__(self, message: str, hint: str | None = None, exit_code: int = EXIT_REFUSED) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.exit_code = exit_code


def exit_codes_help() -> str:
    """The exit-code table as plain text, for ``--help`` epilogs."""
    return "\n".join(f"  {code:<4} {meaning}" for code, meaning in EXIT_CODES)


def report_error(error: CkptrunError, stream: TextIO | None = None) -> int:
    """Write ``error: …`` and ``hint: …`` lines and return the error's exit code."""
    stream = stream if stream is not None else sys.stderr
    stream.write(f"error: {error.message}\n")
    if error.hint:
        stream.write(f"hint: {error.hint}\n")
    stream.flush()
    return error.exit_code


def run_command(fn: Callable[[], int | None], debug: bool = False) -> int:
    """Run ``fn`` and turn its outcome into an exit code (``None`` means 0)."""
    try:
        return fn() or EXIT_OK
    except CkptrunError as error:
        if debug:
            traceback.print_exc(file=sys.stderr)
        return report_error(error)
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc(file=sys.stderr)
        sys.stderr.write("error: interrupted\n")
        return EXIT_INTERRUPTED
    except Exception as error:  # noqa: BLE001 - everything else is our bug
        traceback.print_exc(file=sys.stderr)
        sys.stderr.write(
            f"error: internal error: {type(error).__name__}: {error} (a bug in ckptrun)\n"
            "hint: please report it with the traceback above; --debug shows more context\n"
        )
        return EXIT_BUG


# --- the --debug flag and the command decorator -------------------------------

_debug = False


def set_debug(enabled: bool) -> None:
    """Set by the root callback from the global ``--debug`` option."""
    global _debug
    _debug = enabled


def debug_enabled() -> bool:
    """Whether ``ckptrun --debug`` was given (the workers keep ckptrun's frames in a script's traceback)."""
    return _debug


F = TypeVar("F", bound=Callable[..., "int | None"])


def command(fn: F) -> F:
    """Decorate a typer command so errors are rendered here and its return value is the exit code.

    ``functools.wraps`` keeps the signature, which typer reads for the options.
    """

    @functools.wraps(fn)
    def wrapper(*args: object, **kwargs: object) -> None:
        code = run_command(lambda: fn(*args, **kwargs), debug=_debug)
        if code:
            raise SystemExit(code)

    return wrapper  # type: ignore[return-value]
