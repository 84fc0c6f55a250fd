"""``resume -- ARGS`` overrides the stored options of the same name and keeps the rest (issue 23, item 9)."""

from __future__ import annotations

import pytest

from ckptrun.cli.supervision.script_args import command_line, merge
from ckptrun.cli.supervision.spec import build_spec
from ckptrun.runtime.faults import pending


@pytest.mark.parametrize("stored, new, merged", [
    (["--epochs", "40", "--lr", "3e-4"], ["--lr", "1e-3"], ["--epochs", "40", "--lr", "1e-3"]),
    (["--epochs", "40"], ["--lr", "1e-3"], ["--epochs", "40", "--lr", "1e-3"]),  # a new option is appended
    (["--lr=3e-4", "--steps", "9"], ["--lr=1e-3"], ["--lr=1e-3", "--steps", "9"]),  # --name=value form
    (["--compile", "--steps", "9"], ["--steps", "12"], ["--compile", "--steps", "12"]),  # a bare flag is kept
    (["--shift", "-1", "--steps", "9"], ["--shift", "-2.5"], ["--shift", "-2.5", "--steps", "9"]),  # negative values
    (["config/a.py", "--steps", "9"], ["config/b.py"], ["config/b.py", "--steps", "9"]),  # positionals replaced
    (["--layers", "1", "2", "--lr", "1"], ["--layers", "3"], ["--layers", "3", "--lr", "1"]),  # nargs values
])
def test_new_arguments_override_by_name(stored: list[str], new: list[str], merged: list[str]) -> None:
    assert merge(stored, new) == merged


def test_the_effective_command_line_is_quoted_as_a_shell_takes_it() -> None:
    assert command_line("train.py", ["--name", "a b"]) == "train.py --name 'a b'"
    assert command_line(None, ["--steps", "9"]) == "the default job --steps 9"


def test_a_stored_fault_can_be_dropped_with_none() -> None:
    spec = build_spec({"inject_fault": "kill:rank=1:step=7", "nproc_per_node": "2"})
    assert build_spec({**spec.model_dump(), "inject_fault": ""}).inject_fault is None


def test_a_resume_keeps_only_the_stored_faults_that_can_still_fire() -> None:
    """A kill demo's fault fired on attempt 1; a resume starts at attempt 2 or later, maybe on fewer ranks."""
    stored = "kill:rank=1:step=12;slow-save:ms=5:attempt=any;hang:rank=2:step=9:attempt=any;exit:rank=0:step=3:attempt=4"
    kept, spent = pending(stored, from_attempt=3, world=2)
    assert kept == "slow-save:ms=5:attempt=any;exit:rank=0:step=3:attempt=4"
    assert spent == {"kill:rank=1:step=12": "it fires on attempt 1 only",
                     "hang:rank=2:step=9:attempt=any": "rank 2 is not among the 2 ranks"}
    assert pending("kill:rank=1:step=12", from_attempt=2, world=None) == (None, {"kill:rank=1:step=12": "it fires on attempt 1 only"})
    assert pending(None, from_attempt=2, world=1) == (None, {})
