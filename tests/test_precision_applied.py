"""Precision is reported as applied (issue 23, item 7): a mixed mode counts only where its autocast ran."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from launch_helpers import FIXTURES

from ckptrun.runtime.manifest import read_manifest
from ckptrun.runtime.records import read_events, read_metrics


def test_a_script_that_never_enters_autocast_is_reported_fp32(tmp_path: Path) -> None:
    """Single process (ranks are not the point): bf16 decided, an own loop closed with run.end_step."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTRUN_")}
    env.update(CKPTRUN_RUN_DIR=str(tmp_path / "run"), CKPTRUN_ASYNC_SAVE="0")
    done = subprocess.run([sys.executable, str(FIXTURES / "own_loop_job.py")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = tmp_path / "run"
    told = read_events(run_dir, "precision")
    assert told[0]["mode"] == "bf16" and told[-1]["mode"] == "fp32" and told[-1]["decided"] == "bf16", told
    assert {r["precision"] for r in read_metrics(run_dir) if "step" in r} == {"fp32"}
    assert read_manifest(run_dir / "checkpoints" / "step-000000004").precision == "fp32"
    assert "never entered its autocast" in done.stderr


def test_the_policy_counts_a_mixed_mode_only_once_its_autocast_ran() -> None:
    from ckptrun.runtime.step.precision import Decision, Policy

    policy = Policy(Decision("auto", "bf16", "test", "cpu"))
    assert policy.applied_mode == "fp32"
    with policy.autocast():
        pass
    assert policy.applied_mode == "bf16"
    assert Policy(Decision("fp32", "fp32", "test", "cpu")).applied_mode == "fp32"
