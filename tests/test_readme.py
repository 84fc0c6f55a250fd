"""The README cannot drift: every command in its ```console blocks runs, in order, in one fresh directory.

Blocks run as one bash script with ``set -e`` (a failing command fails the
test), so later blocks may use what earlier ones made (the tutorial's run).
``make`` lines are the set-up commands of the first block (make test would
recurse); they are checked by CI itself. Runs are kept short through the
documented flags in the commands, not by editing them here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from workers import kill_run

README = Path(__file__).parent.parent / "README.md"
BLOCK = re.compile(r"```console\n(.*?)```", re.S)


def readme_commands() -> list[str]:
    commands = []
    for block in BLOCK.findall(README.read_text()):
        for line in block.splitlines():
            line = line.removeprefix("$ ").strip()
            if line and not line.startswith(("#", "make ")):
                commands.append(line)
    return commands


def test_readme_starts_with_the_two_commands():
    first = BLOCK.findall(README.read_text())[0]
    assert "make demo" in first and "make test" in first
    assert "make test" in (Path(__file__).parent.parent / ".ci" / "run").read_text()


@pytest.mark.timeout(600)
def test_every_readme_command_runs(tmp_path):
    commands = readme_commands()
    assert len(commands) > 10
    script = "set -euo pipefail\n" + "\n".join(f"echo '>>> {c.replace(chr(39), '')}' >&2\n{c}" for c in commands)
    # the directory stands for the checkout after `make demo`: ckptrun sits in .venv/bin, off the PATH until
    # the README's own first command puts it there
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parent.parent, target_is_directory=True)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "NO_COLOR": "1"}
    env.pop("CKPTRUN_RUN_ID", None)
    process = subprocess.Popen(["bash", "-c", script], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = process.communicate(timeout=560)
    finally:
        for run_json in tmp_path.rglob("run.json"):
            kill_run(json.loads(run_json.read_text()).get("run_id", ""))
    assert process.returncode == 0, f"a README command failed:\n{err[-4000:]}"
    # the tutorial's preflight of the char-GPT template (`--steps 2000`) passes every check, not only exits 0
    [preflight] = tmp_path.rglob("preflight.json")  # runs/demo-preflight, beside the tutorial's run
    document = json.loads(preflight.read_text())
    assert all(check["verdict"] == "pass" for check in document["checks"]), document["checks"]
    assert any(line.startswith("preflight: PASS") for line in out.splitlines()), out[-3000:]
    assert "exit 4" in out.splitlines()  # the README's `|| echo "exit $?"` after the broken resume
    assert_the_broken_resume_diverged(tmp_path / "my-gpt" / "runs" / "broken-resume", said(err, "--name broken-resume"))


def said(err: str, words: str) -> str:
    """What the README command containing ``words`` wrote to stderr (up to the next command's echo)."""
    return next(block for block in err.split("\n>>> ") if words in block.partition("\n")[0])


def assert_the_broken_resume_diverged(run_dir: Path, stderr: str) -> None:
    """`--require-exact-resume` with the RNG not restored (the README's `# 4: the resume diverged`): attempt 2 replays
    the steps since snapshot 10, they differ, the run exits 4 and nothing saved after the divergence stays in
    the line."""
    from launch_helpers import events, one

    from ckptrun.runtime.checkpoint.verify import newest_verified
    from ckptrun.runtime.storage.store import current_lineage

    assert "error: the resumed run diverged from the original (--require-exact-resume)" in stderr, stderr[-3000:]
    assert "hint: " in stderr and "Traceback" not in stderr
    restart, failure = one(run_dir, "restart"), one(run_dir, "failure")
    # the kill after step 12 restarts from the newest snapshot published before it (10, or 5 while 10 persisted)
    published = [e["step"] for e in events(run_dir, "snapshot_saved") if e["time"] < failure["time"]]
    snap = restart["snapshot_step"]
    assert snap == max(published) and snap in (5, 10) and restart["resume_verdict"] == "diverged", restart
    assert restart["resume_max_rel_diff"] > 0 and restart["replayed_steps"] >= 1
    assert one(run_dir, "gave_up")["exit_code"] == 4 and len(events(run_dir, "attempt_start")) == 2
    ckpt = run_dir / "checkpoints"  # nothing after the divergence usable: a save that landed was moved out of the line
    assert [m.step for _, m in current_lineage(ckpt)] == list(range(5, snap + 1, 5)) and newest_verified(ckpt).step == snap
    moved = [Path(p) for e in events(run_dir, "snapshots_abandoned") for p in e["snapshots"]]
    assert all(p.exists() and p.parent.parent.name == "abandoned" for p in moved)
    assert ("nothing after the divergence was saved" in stderr) != bool(moved), stderr[-1000:]
