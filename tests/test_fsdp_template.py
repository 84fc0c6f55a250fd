"""`ckptrun init --template fsdp`: the FSDP2 template, as a user gets it, killed and resumed exactly on 2 CPU ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
from launch_helpers import COMMON, ckptrun, events
from workers import run_job

from ckptrun.runtime.records import final_losses, read_events, same_float

STEPS = ["--steps", "12"]
# fp32: the same on every CPU (auto picks bf16 where the CPU has AMX)
FLAGS = [*COMMON, "--precision", "fp32", "--threads", "1"]


@pytest.mark.e2e
@pytest.mark.timeout(420)
def test_fsdp_template_killed_on_two_ranks_resumes_bitwise(tmp_path: Path) -> None:
    made = ckptrun("init", "project", "--template", "fsdp", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    script = str(tmp_path / "project" / "train.py")
    ref = ckptrun("launch", *FLAGS, "--run-dir", "ref", script, *STEPS, cwd=tmp_path, timeout=180)
    assert ref.returncode == 0, ref.stderr[-3000:]
    killed = ckptrun("launch", *FLAGS, "--run-dir", "killed", "--inject-fault", "kill:rank=1:step=7",
                     script, *STEPS, cwd=tmp_path, timeout=180)
    assert killed.returncode == 0, killed.stderr[-3000:]

    [restart] = events(tmp_path / "killed", "restart")
    assert restart["snapshot_step"] == 5  # resumed from the FSDP2 snapshot, not from the start
    expected, resumed = final_losses(tmp_path / "ref"), final_losses(tmp_path / "killed")
    assert sorted(expected) == sorted(resumed) == list(range(1, 13))
    assert all(same_float(expected[step], resumed[step]) for step in expected), (expected, resumed)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_the_fsdp_template_runs_with_its_defaults_on_four_ranks(tmp_path: Path) -> None:
    """Issue 38: the FSDP2 template's default --global-batch 48 refused 4 ranks ("pick a multiple of 32"). Its
    default is now 48 rounded to a multiple of batch-size x ranks (64 here): two steps under plain torchrun (the
    runtime alone), and the final snapshot published. (The other templates take no global batch.)"""
    run_dir = tmp_path / "run"
    result = run_job(run_dir, nproc=4, module="ckptrun.templates.fsdp", args=("--steps", "2"),
                     precision="fp32", timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [e["step"] for e in read_events(run_dir, "snapshot_saved")] == [2]
    assert max(final_losses(run_dir)) == 2
