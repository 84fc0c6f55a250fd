"""A plain script that needs a flag to resume (issue 23, items 2 and 3).

With ``--restart-args --resume`` the restart resumes from the script's own checkpoint, every rank sees
``CKPTRUN_RESTART=1``, and the lost steps, the step records and "completed at step" are global steps read from
the optimizer. Without it the restart starts over: ckptrun says so (``started_over``), never "resumes".
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch_helpers import COMMON, FIXTURES, PLAIN_EXIT_ALLOWANCE, Cleanup, assert_no_processes, ckptrun, events, one

from ckptrun.runtime.records import read_metrics

SCRIPT = str(FIXTURES / "flag_resume_ddp.py")
KILL = ["--inject-fault", "kill:rank=1:step=7"]


def logged(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "losses.jsonl").read_text().splitlines()]


def attempt_steps(lines: list[dict]) -> tuple[list[int], list[int]]:
    """Rank 0's logged steps in attempts 1 and 2. Rank 1 is killed in its step-7 hook while rank 0 finishes
    the same step: torchrun may end rank 0 before it logs step 7, so a 6 there is the same run."""
    first, second = ([r["step"] for r in lines if r["attempt"] == a] for a in ("1", "2"))
    return (first + [7] if first == [*range(1, 7)] else first), second


@pytest.mark.e2e
@pytest.mark.timeout(200)
def test_restart_args_resume_the_script_and_the_lost_steps_are_true(tmp_path: Path, cleanup: Cleanup) -> None:
    run_dir, out = cleanup.run_dir(tmp_path / "runs" / "flag"), tmp_path / "out"
    result = ckptrun("launch", *COMMON, *PLAIN_EXIT_ALLOWANCE, *KILL, "--name", "flag", "--restart-args", "--resume", SCRIPT,
                     "--out", str(out), "--steps", "12", cwd=tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = logged(out)
    assert attempt_steps(lines) == ([*range(1, 8)], [*range(6, 13)]), lines  # killed after 7, resumed from its step 5
    assert {r["restart"] for r in lines if r["attempt"] == "1"} == {"0"}
    assert {r["restart"] for r in lines if r["attempt"] == "2"} == {"1"}
    restart = one(run_dir, "restart")
    assert (restart["resumed_step"], restart["lost_steps"]) == (5, 2)
    assert not events(run_dir, "started_over")
    assert "resumed from its own checkpoint at step 5" in result.stderr
    assert "run completed at step 12" in result.stderr
    steps = {a: [int(m["step"]) for m in read_metrics(run_dir) if m.get("attempt") == a and "step" in m] for a in (1, 2)}
    assert steps[2] and min(steps[2]) == 6 and max(steps[2]) == 12, steps  # the step hook's records: global steps
    status = ckptrun("status", str(run_dir), "--json", cwd=tmp_path)
    document = json.loads(status.stdout)  # status too: global steps, not the 7th step of attempt 2
    assert document["progress"]["step"] == 12 and {r["step"] for r in document["ranks"]} == {12}, status.stdout[-2000:]
    assert json.loads((run_dir / "run.json").read_text())["spec"]["restart_args"] == ["--resume"]
    assert_no_processes(run_dir, within=5)


@pytest.mark.e2e
@pytest.mark.timeout(200)
def test_a_restart_that_started_over_is_said(tmp_path: Path, cleanup: Cleanup) -> None:
    run_dir, out = cleanup.run_dir(tmp_path / "runs" / "over"), tmp_path / "out"
    result = ckptrun("launch", *COMMON, *PLAIN_EXIT_ALLOWANCE, *KILL, "--name", "over", SCRIPT, "--out", str(out), "--steps", "10",
                     cwd=tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert attempt_steps(logged(out)) == ([*range(1, 8)], [*range(1, 11)])
    over = one(run_dir, "started_over")
    assert (over["attempt"], over["previous_step"]) == (2, 7)
    assert one(run_dir, "restart")["lost_steps"] == 7
    assert "started over at step 1" in result.stderr and "--restart-args" in result.stderr
    # nothing claims a resume the step count does not show: no line says it resumes from its own files
    assert "own files" not in result.stderr and "resumed from its own checkpoint" not in result.stderr, result.stderr
    assert_no_processes(run_dir, within=5)
