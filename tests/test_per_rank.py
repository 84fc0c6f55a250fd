"""Per-rank state (issue 23, item 5): ``run.track(..., per_rank=True)`` stores one copy per rank and gives each
rank its own back; without it, a tracked tensor that differs across ranks is refused at the first save."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch_helpers import COMMON, FIXTURES, Cleanup, assert_no_processes, ckptrun, events

SCRIPT = str(FIXTURES / "per_rank_job.py")


@pytest.mark.e2e
@pytest.mark.timeout(200)
def test_per_rank_state_comes_back_to_its_own_rank(tmp_path: Path, cleanup: Cleanup) -> None:
    run_dir = cleanup.run_dir(tmp_path / "runs" / "own")
    result = ckptrun("launch", *COMMON, "--name", "own", "--inject-fault", "kill:rank=1:step=7", SCRIPT,
                     "--steps", "10", "--per-rank", cwd=tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert events(run_dir, "restart")[0]["snapshot_step"] == 5
    for rank in (0, 1):
        restored = json.loads((run_dir / f"restored-rank-{rank}.json").read_text())
        assert restored["step"] == 5 and restored["batch"] == [rank, 5.0, rank * 100 + 5.0], restored
    assert_no_processes(run_dir, within=5)


@pytest.mark.e2e
@pytest.mark.timeout(150)
def test_a_tensor_that_differs_across_ranks_is_refused(tmp_path: Path, cleanup: Cleanup) -> None:
    run_dir = cleanup.run_dir(tmp_path / "runs" / "mixed")
    result = ckptrun("launch", *COMMON, "--name", "mixed", SCRIPT, "--steps", "10", cwd=tmp_path, timeout=140)
    assert result.returncode == 4, result.stderr[-3000:]
    assert "track(prefetched=...): its tensors differ across ranks" in result.stderr
    assert "per_rank=True" in result.stderr
    assert len(events(run_dir, "attempt_start")) == 1 and not events(run_dir, "snapshot_saved")
    assert_no_processes(run_dir, within=5)
