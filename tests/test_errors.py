"""The one place errors become output and exit codes (cli/errors.py)."""

from __future__ import annotations

import pytest

from ckptrun.cli import errors
from ckptrun.cli.errors import CkptrunError, run_command


def fail(exc: BaseException):
    def fn() -> int:
        raise exc

    return fn


def test_ckptrun_error_prints_error_and_hint_only(capsys: pytest.CaptureFixture[str]) -> None:
    code = run_command(fail(CkptrunError("run dir runs/a is busy", hint="wait for pid 12", exit_code=3)))
    out, err = capsys.readouterr()
    assert code == 3 and out == ""
    assert err == "error: run dir runs/a is busy\nhint: wait for pid 12\n"


def test_ckptrun_error_defaults_to_refused_and_debug_adds_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_command(fail(CkptrunError("bad flag")), debug=True) == errors.EXIT_REFUSED == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.endswith("error: bad flag\n")


def test_any_other_exception_is_our_bug(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_command(fail(KeyError("oops"))) == errors.EXIT_BUG == 101
    err = capsys.readouterr().err
    assert "Traceback" in err and "error: internal error: KeyError: 'oops' (a bug in ckptrun)" in err


def test_return_value_is_the_exit_code() -> None:
    assert run_command(lambda: None) == 0
    assert run_command(lambda: errors.EXIT_NO) == 1


def test_decorated_command_exits_with_its_code() -> None:
    @errors.command
    def answer(value: int) -> int:
        """Docstring kept for typer's help."""
        return value

    assert answer(0) is None and answer.__doc__ == "Docstring kept for typer's help."
    with pytest.raises(SystemExit) as caught:
        answer(4)
    assert caught.value.code == 4


def test_exit_code_table_lists_every_code() -> None:
    table = errors.exit_codes_help().splitlines()
    assert [int(line.split()[0]) for line in table] == [0, 1, 2, 3, 4, 5, 101]
