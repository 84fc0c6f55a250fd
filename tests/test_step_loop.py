"""Issue 10 item 8 (runtime): the step loop's metrics and where a stop happens.

One process under plain python (the ranks are not the point): ``metrics.jsonl``'s ``lr`` is the rate
the step used (not the one the scheduler set for the next step), ``train_step(metrics=...)`` logs a
custom metric, and an agreed stop lets the code after ``train_step`` run on the stop step first.
"""

from __future__ import annotations

import pytest

from ckptrun.runtime.records import read_events, read_metrics
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
    assert "after step 3" in result.stdout and "after step 4" not in result.stdout
    assert [e["step"] for e in read_events(run_dir, "stopped")] == [3]
    assert (run_dir / "checkpoints" / "step-000000003").is_dir()
