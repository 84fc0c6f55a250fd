"""Completion is final (issue 23, item 6): ``run.finish()`` leaves a process group the script created, and an
attempt that logged ``completed`` is never restarted — a crash after it is exit 0 with a warning."""

from __future__ import annotations

from pathlib import Path

import pytest
from launch_helpers import COMMON, FIXTURES, Cleanup, assert_no_processes, ckptrun, events, one

SCRIPT = str(FIXTURES / "own_group_job.py")


@pytest.mark.e2e
@pytest.mark.timeout(200)
@pytest.mark.parametrize("crash", [False, True], ids=["destroys-its-group", "crashes-after-finish"])
def test_a_completed_run_is_never_restarted(tmp_path: Path, cleanup: Cleanup, crash: bool) -> None:
    run_dir = cleanup.run_dir(tmp_path / "runs" / "own")
    extra = ["--crash-after-finish"] if crash else []
    result = ckptrun("launch", *COMMON, "--name", "own", SCRIPT, "--steps", "6", *extra, cwd=tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(events(run_dir, "attempt_start")) == 1 and not events(run_dir, "restart")
    assert one(run_dir, "run_completed")["step"] == 6
    after = events(run_dir, "crashed_after_completion")
    if crash:
        assert len(after) == 1 and after[0]["step"] == 6 and "after the run completed at step 6" in result.stderr
    else:
        assert not after  # finish() left the script's group: its own destroy_process_group() worked
    assert (run_dir / "checkpoints" / "step-000000006" / "manifest.json").exists()  # the final snapshot is kept
    assert_no_processes(run_dir, within=5)
