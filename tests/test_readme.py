"""The README cannot drift: every command in its ```console blocks runs, in order, in one fresh directory.

Blocks run as one bash script with ``set -e`` (a failing command fails the
test), so later blocks may use what earlier ones made (the tutorial's run).
``make`` lines are the set-up commands of the first block (make test would
recurse); they are checked by CI itself. Runs are kept short through the
documented flags in the commands, not by editing them here.
"""

from __future__ import annotations

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
            kill_run(__import__("json").loads(run_json.read_text()).get("run_id", ""))
    assert process.returncode == 0, f"a README command failed:\n{err[-4000:]}"
