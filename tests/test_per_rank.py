"""Per-rank state (issue 23, item 5): ``run.track(..., per_rank=True)`` stores one copy per rank and gives each
rank its own back; without it, a tracked tensor that differs across ranks is refused at the first save."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from launch_helpers import COMMON, FIXTURES, Cleanup, assert_no_processes, ckptrun, events

SCRIPT = str(FIXTURES / "per_rank_job.py")
FIRST_SCRIPT = str(FIXTURES / "first_script.py")


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


@pytest.mark.e2e
@pytest.mark.timeout(200)
def test_a_first_script_whose_unwrapped_model_differs_across_ranks_keeps_each_ranks_own_and_resumes_exactly(
        tmp_path: Path, cleanup: Cleanup) -> None:
    """Issue 38: an unwrapped ``nn.Linear`` built on each rank with no shared seed, 2 ranks. It ran before the
    replica check came, then ended exit 4 after 3 attempts ("replicas diverged … suspect device", no snapshot to
    go back to). Now the model differs when tracked, so it is per-rank state (one note), with its optimizer; a
    kill after step 7 restarts from step 5 and the replayed steps' losses repeat the first attempt's bitwise."""
    run_dir = cleanup.run_dir(tmp_path / "runs" / "first")
    result = ckptrun("launch", *COMMON, "--name", "first", "--inject-fault", "kill:rank=1:step=7", FIRST_SCRIPT,
                     cwd=tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    notes = [line for line in (result.stdout + result.stderr).splitlines() if "differs across ranks when tracked" in line]
    assert len(notes) == 1 and "per-rank state and its optimizer" in notes[0], result.stderr[-2000:]
    assert [e["objects"] for e in events(run_dir, "per_rank_state")] == [["model", "optimizer"]]
    assert events(run_dir, "restart")[0]["snapshot_step"] == 5 and not events(run_dir, "replicas_diverged")
    [replayed] = re.findall(r"resume check: exact over (\d+) replayed step", result.stderr)
    assert int(replayed) >= 2, result.stderr[-2000:]  # steps 6 and 7 at least (rank 0 may finish step 8 too)
    finals = [(run_dir / f"final-{rank}.json").read_text() for rank in (0, 1)]
    assert finals[0] != finals[1], "each rank trained its own model"
    assert_no_processes(run_dir, within=5)


@pytest.mark.e2e
@pytest.mark.timeout(150)
def test_replicas_that_drift_with_no_ddp_wrapper_are_refused_at_once_naming_the_cause(
        tmp_path: Path, cleanup: Cleanup) -> None:
    """The same model seeded alike on every rank, each rank on its own data, nothing wrapping it: the replicas
    drift, and the first save says why in one line and exits 4 in the first attempt (a restart drifts the same
    way, and before that save no snapshot agreed: there is nothing to go back to)."""
    run_dir = cleanup.run_dir(tmp_path / "runs" / "drift")
    result = ckptrun("launch", *COMMON, "--name", "drift", FIRST_SCRIPT, "--seed-alike", cwd=tmp_path, timeout=140)
    assert result.returncode == 4, result.stderr[-3000:]
    assert "nothing synchronises the gradients across ranks" in result.stderr.splitlines()[-2], result.stderr[-2000:]
    assert "suspect device" not in result.stderr
    assert len(events(run_dir, "attempt_start")) == 1 and not events(run_dir, "snapshot_saved")
    assert [e["cause"] for e in events(run_dir, "replicas_diverged")] == ["unsynchronised"]
    assert_no_processes(run_dir, within=5)
