"""Rollback (``--on-anomaly rollback``) falls back past a snapshot that verifies but does not load, as restore does.

Single-process runs of the default template: the ranks are not the point here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckptrun.runtime.hashing import hash_file
from ckptrun.runtime.records import read_events, read_metrics
from workers import run_job

FAST = ("--num-workers", "0", "--hidden", "128")


def make_unloadable(snapshot: Path) -> None:
    """Garbage in the rank's tensor file, with the manifest updated so that the snapshot still verifies."""
    target = snapshot / "rank-00000.safetensors"
    target.write_bytes(b"not a torch file" * 8)
    size, digest = hash_file(target, "sha256")
    document = json.loads((snapshot / "manifest.json").read_text())
    next(f for f in document["files"] if f["path"] == "rank-00000.safetensors").update(size=size, digest=digest)
    (snapshot / "manifest.json").write_text(json.dumps(document))


@pytest.mark.timeout(180)
def test_rollback_skips_a_newest_snapshot_that_does_not_load(tmp_path):
    run_dir = tmp_path / "run"
    first = run_job(run_dir, args=("--steps", "10", *FAST), precision="fp32", save_every_steps=5)
    assert first.returncode == 0, first.stderr[-3000:]
    make_unloadable(run_dir / "checkpoints" / "step-000000010")
    # attempt 2 restores step 5 (10 does not load), trains on, and the NaN after step 7 rolls back
    second = run_job(run_dir, args=("--steps", "14", *FAST), precision="fp32", save_every_steps=5, attempt=2,
                     on_anomaly="rollback", fault="nan:step=7:attempt=2")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "Traceback" not in second.stderr
    [rollback] = read_events(run_dir, "rollback")
    assert rollback["snapshot"].endswith("step-000000005") and rollback["to_step"] == 5
    failed = [e["snapshot"] for e in read_events(run_dir, "restore_failed")]
    assert failed and all(path.endswith("step-000000010") for path in failed), failed
    assert read_metrics(run_dir)[-1]["step"] == 14 and read_events(run_dir, "completed")
