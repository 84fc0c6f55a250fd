"""The README's adoption diff turns a stock DDP script into a resumable one.

The test applies the committed diff to the committed stock script with
``patch``, runs the result on 2 ranks under plain torchrun, kills rank 1, runs
it again, and checks the resumed steps replay the killed attempt's losses
bitwise. The README must show exactly this diff.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from ckptrun.runtime.records import losses_by_attempt, read_events
from workers import run_job

FIXTURES = Path(__file__).parent / "fixtures"
README = Path(__file__).parent.parent / "README.md"


def test_readme_shows_the_adoption_diff():
    diff = (FIXTURES / "adopt_runtime.diff").read_text()
    assert diff in README.read_text()
    changed = [line for line in diff.splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    assert len([line for line in changed if line.strip() not in "+-"]) <= 25, "the adoption stays small"


@pytest.mark.timeout(180)
def test_patched_stock_script_survives_a_kill_on_two_ranks(tmp_path):
    script = tmp_path / "stock_ddp.py"
    shutil.copy(FIXTURES / "stock_ddp.py", script)
    subprocess.run(["patch", "-s", str(script), str(FIXTURES / "adopt_runtime.diff")], check=True)
    run_dir = tmp_path / "run"
    killed = run_job(run_dir, nproc=2, script=script, args=("--steps", "24"), save_every_steps=8, fault="kill:rank=1:step=13")
    assert killed.returncode != 0
    resumed = run_job(run_dir, nproc=2, script=script, args=("--steps", "24"), save_every_steps=8, attempt=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [e["step"] for e in read_events(run_dir, "restored")] == [8]
    first, second = losses_by_attempt(run_dir)[1], losses_by_attempt(run_dir)[2]
    assert sorted(second) == list(range(9, 25))
    replayed = [s for s in range(9, 14) if s in first]  # the kill may take the last unshared batch of lines with it
    assert replayed and [first[s] for s in replayed] == [second[s] for s in replayed], "replayed steps are bitwise equal"
    assert "step 20 loss" in resumed.stdout
