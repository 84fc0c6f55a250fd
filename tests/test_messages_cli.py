"""Every message true, every refusal one line (issue 28): what a new user still met, one test per item.

Refusals are asserted line for line on stderr (``error:`` then ``hint:``, no click ``Usage:`` block), with
their exit code and nothing created.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from launch_helpers import ckptrun


# --- item 1: every parse error goes through the one error renderer -----------------------------------


@pytest.mark.parametrize("argv, lines", [
    (["lauch"], ["error: No such command 'lauch'.", "hint: did you mean 'launch'? see `ckptrun --help`"]),
    (["launch", "--save-every-steps", "ten", "train.py"],
     ["error: Invalid value for '--save-every-steps': Input should be a valid integer, unable to parse string as an integer",
      "hint: see `ckptrun launch --help`"]),
    (["status", "--rto-budget"], ["error: Option '--rto-budget' requires an argument.", "hint: see `ckptrun status --help`"]),
    (["verify", "a", "b"], ["error: Got unexpected extra argument(s) (b)", "hint: see `ckptrun verify --help`"]),
])
def test_a_parse_error_is_one_error_line_and_one_hint(tmp_path: Path, argv: list[str], lines: list[str]) -> None:
    (tmp_path / "train.py").write_text("open('ran', 'w').close()\n")
    result = ckptrun(*argv, cwd=tmp_path, timeout=60)
    assert (result.returncode, result.stderr.splitlines()) == (2, lines)
    assert result.stdout == "" and not (tmp_path / "runs").exists() and not (tmp_path / "ran").exists()
