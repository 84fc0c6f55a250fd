"""`ckptrun launch` when state or storage is bad (issue 24): completion means the final snapshot is published,
unusable locations are refused before anything starts, a poisoned snapshot is blamed, not looped on."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from launch_helpers import FIXTURES, Cleanup, assert_no_processes, ckptrun, events

from ckptrun.runtime.records import final_losses
from ckptrun.runtime.storage import store

pytestmark = pytest.mark.e2e
ONE_RANK = ["--nproc-per-node", "1", "--save-every-steps", "5", "--heartbeat-timeout", "5", "--startup-timeout", "60",
            "--restart-backoff", "0.1"]
TWO_RANKS = ["--nproc-per-node", "2", *ONE_RANK[2:]]


@pytest.mark.timeout(60)
def test_unusable_local_paths_are_refused_with_exit_2_before_anything_starts(tmp_path: Path) -> None:
    """A --ckpt-dir that is a regular file, a run dir under /proc. Before: an internal error (exit 101)."""
    regular = tmp_path / "a-file"
    regular.write_text("")
    for args, named in ((["--ckpt-dir", str(regular), "--run-dir", str(tmp_path / "r1")], "--ckpt-dir"),
                        (["--run-dir", "/proc/ckptrun-no-such-run"], "--run-dir")):
        result = ckptrun("launch", *ONE_RANK, *args, "--", "--steps", "2", cwd=tmp_path)
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith(f"error: {named} ") and "hint: " in result.stderr
        assert "Traceback" not in result.stderr
    assert not (tmp_path / "r1" / "run.json").exists()


@pytest.mark.timeout(240)
def test_a_failed_final_save_exits_1_naming_the_newest_snapshot_and_resume_continues(tmp_path: Path,
                                                                                     cleanup: Cleanup) -> None:
    """ENOSPC from step 26 of 30 (a snapshot every 5): the final save fails, the launch exits 1 naming step 25
    and `resume --latest`, which then continues to a published step 30. Before: "run completed", exit 0,
    newest snapshot 25, and resume refused as "already completed". The same run's store made unreachable:
    `status` says so with exit 1 (before: KeyError, exit 101)."""
    run_dir = cleanup.run_dir(tmp_path / "runs" / "final")
    failed = ckptrun("launch", *ONE_RANK, "--name", "final", "--inject-fault", "enospc:step=26", cwd=tmp_path, timeout=200)
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert "the final save at step 30 failed: the newest snapshot is step 25" in failed.stderr
    assert "ckptrun resume --latest" in failed.stderr and not events(run_dir, "run_completed")
    resumed = ckptrun("resume", "--latest", "--run-dir", str(run_dir), cwd=tmp_path, timeout=200)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "already completed" not in resumed.stderr
    steps = [e.step for e in store.list_entries(run_dir / "checkpoints") if e.kind == "published"]
    assert max(steps) == 30
    assert_no_processes(run_dir, within=20)
    record = json.loads((run_dir / "run.json").read_text())
    record["spec"]["store_url"] = "s3://ckptrun-no-such-bucket/x"
    record["spec"]["store_options"] = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}}
    (run_dir / "run.json").write_text(json.dumps(record))
    status = ckptrun("status", str(run_dir), cwd=tmp_path)
    assert status.returncode == 1, status.stderr[-2000:]
    assert "cannot be listed" in status.stdout and "Traceback" not in status.stderr


@pytest.mark.timeout(300)
def test_a_snapshot_that_poisons_the_run_is_quarantined_and_the_run_restarts_from_the_one_before(
        tmp_path: Path, cleanup: Cleanup) -> None:
    """Killed at step 17, the restart restores snapshot 15 whose values are poison (NaN right after loading):
    15 is quarantined as poisoned (step and loss in reason.json), the next attempt restores 10 and the run
    completes with finite losses in at most 3 attempts. Before: the run went on from 15 on NaN and exited 0."""
    run_dir = cleanup.run_dir(tmp_path / "runs" / "poison")
    result = ckptrun("launch", *TWO_RANKS, "--name", "poison", "--inject-fault",
                     "kill:rank=1:step=17;poison-after-restore:step=15", str(FIXTURES / "state_job.py"),
                     "--steps", "25", cwd=tmp_path, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    quarantined = [e for e in events(run_dir, "snapshot_quarantined") if e.get("cause") == "poisoned"]
    assert [e["step"] for e in quarantined] == [15], quarantined
    reason = json.loads((Path(quarantined[0]["moved_to"]).parent / "reason.json").read_text())
    assert reason["status"] == "poisoned" and reason["step"] in (16, 17, 18) and reason["loss"] == "nan"
    restored = [Path(e["snapshot"]).name for e in events(run_dir, "restored")]
    assert restored == [store.snapshot_name(15), store.snapshot_name(10)], restored
    assert len(events(run_dir, "attempt_start")) <= 3
    losses = final_losses(run_dir)
    assert max(losses) == 25 and all(math.isfinite(v) for v in losses.values())
    assert_no_processes(run_dir, within=20)
