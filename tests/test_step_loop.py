"""Issue 10 item 8 (runtime): the step loop's metrics and where a stop happens.

One process under plain python (the ranks are not the point): ``metrics.jsonl``'s ``lr`` is the rate
the step used (not the one the scheduler set for the next step), ``train_step(metrics=...)`` logs a
custom metric, an agreed stop lets the code after ``train_step`` run on the stop step first, and the
README shows ``train_step`` with the parameters the code has.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from ckptrun.runtime.records import read_events, read_metrics
from ckptrun.runtime.step.session import Run
from launch_helpers import FIXTURES
from workers import run_job

SCRIPT = FIXTURES / "step_loop.py"


@pytest.mark.timeout(120)
def test_metrics_log_the_lr_each_step_used_and_custom_metrics(tmp_path):
    result = run_job(tmp_path / "run", script=SCRIPT, args=("--steps", "4"))
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(tmp_path / "run")
    assert [r["lr"] for r in records] == [0.1, 0.05, 0.025, 0.0125]  # StepLR(gamma=0.5) from 0.1
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in records)


@pytest.mark.timeout(120)
def test_a_stop_happens_after_the_code_that_follows_train_step(tmp_path):
    run_dir = tmp_path / "run"
    result = run_job(run_dir, script=SCRIPT, args=("--steps", "8", "--stop-at", "3"))
    assert result.returncode == 3, result.stderr[-3000:]
    # asked during step 3, agreed with step 3's facts when step 4 ends (one step late), taken after step 4's code
    assert "after step 4" in result.stdout and "after step 5" not in result.stdout
    assert [e["step"] for e in read_events(run_dir, "stopped")] == [4]
    assert (run_dir / "checkpoints" / "step-000000004").is_dir()
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4], "every step before the stop has its line"


def test_the_readme_shows_the_step_calls_as_the_code_defines_them():
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    for name in ("train_step", "batches"):
        documented = re.search(rf"`run\.{name}\(([^)]*)\)`", readme).group(1)
        names = [part.strip().split("=")[0] for part in documented.split(",")]
        assert names == [p for p in inspect.signature(getattr(Run, name)).parameters if p != "self"], name
