"""Lightning and the Hugging Face Trainer under ``ckptrun launch``, through ``ckptrun.integrations`` (issue 23).

One launch per framework walks the whole story on 2 CPU ranks (gloo): a rank killed at global step 12 →
the restart resumes from the newest verified checkpoint (step 10) and the global step continues;
``ckptrun stop`` → the framework saves a checkpoint at an agreed step, the launch exits 3; ``ckptrun verify``
checks the checkpoint directory; a flipped byte in the newest checkpoint fails verify and makes
``resume --latest`` use the one before it; the resumed run completes at the global step it was asked for.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
from launch_helpers import (COMMON, FIXTURES, Cleanup, assert_no_processes, ckptrun, events, one, start, tail,
                            wait_for)

from ckptrun.runtime.checkpoint import framework_files
from ckptrun.runtime.records import read_metrics

STEPS, KILL_AT, EVERY = 40, 12, 5
FRAMEWORKS = {  # fixture, its checkpoint-directory option
    "lightning": ("lightning_job.py", "--ckpt-dir"),
    "transformers": ("hf_trainer_job.py", "--output-dir"),
}


@pytest.fixture
def cleanup() -> Iterator[Cleanup]:
    helper = Cleanup()
    yield helper
    helper.close()


def started_at(run_dir: Path, attempt: int) -> int:
    return next(int(e["step"]) for e in events(run_dir, "framework_started") if e["attempt"] == attempt)


def attempt_steps(run_dir: Path, attempt: int) -> list[int]:
    return [int(r["step"]) for r in read_metrics(run_dir) if r.get("attempt") == attempt]


def flip_a_byte(checkpoint: Path) -> None:
    target = max((p for p in ([checkpoint] if checkpoint.is_file() else checkpoint.rglob("*")) if p.is_file()
                  and p.name != "ckptrun-manifest.json"), key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))


@pytest.mark.e2e
@pytest.mark.timeout(420)
@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_kill_stop_verify_and_a_corrupt_checkpoint(tmp_path: Path, cleanup: Cleanup, framework: str) -> None:
    script, dir_option = FRAMEWORKS[framework]
    run_dir, ckpts = cleanup.run_dir(tmp_path / "runs" / framework), tmp_path / "ckpts"
    launcher = cleanup.track(start("launch", *COMMON, "--name", framework, "--inject-fault", f"kill:rank=1:step={KILL_AT}",
                                   str(FIXTURES / script), "--steps", str(STEPS), "--ckpt-every", str(EVERY),
                                   dir_option, str(ckpts), "--step-delay", "0.25", cwd=tmp_path, log=tmp_path / "launch.log"))
    # the kill: attempt 2 resumes from the newest verified checkpoint, its global steps go on from there
    wait_for(lambda: [e for e in events(run_dir, "framework_started") if e["attempt"] == 2], timeout=180,
             what="attempt 2 to start training")
    assert started_at(run_dir, 1) == 0 and started_at(run_dir, 2) == 10
    failure = one(run_dir, "failure")
    assert (failure["rank"], failure["step"], failure["plain_script"]) == (1, KILL_AT, False)
    wait_for(lambda: len(attempt_steps(run_dir, 2)) >= 3, timeout=120, what="three steps of attempt 2")
    assert min(attempt_steps(run_dir, 2)) == 11  # the global step, not the attempt's own count
    # the stop: a checkpoint at a step every rank agreed on, exit 3
    stop = ckptrun("stop", str(run_dir), cwd=tmp_path, timeout=150)
    assert stop.returncode == 0, stop.stderr
    assert launcher.wait(timeout=120) == 3, tail(tmp_path / "launch.log")
    stopped = [e for e in events(run_dir, "stopped") if e["attempt"] == 2][-1]
    saved, at = Path(stopped["checkpoint"]), int(stopped["step"])
    assert stopped["framework"] == framework and 11 < at < STEPS and saved.exists(), stopped
    assert "saved its checkpoint at step" in stop.stderr
    assert one(run_dir, "restart")["lost_steps"] == KILL_AT - 10  # from the checkpoint it resumed from, not from 0
    assert_no_processes(run_dir, within=10)
    # verify: every published checkpoint checks; the stop checkpoint is the newest
    checked = ckptrun("verify", str(ckpts), "--json", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    verdicts = json.loads(checked.stdout)["framework_checkpoints"]
    published = [v for v in verdicts if v["status"] == "ok"]
    assert published and max(v["step"] for v in published) == at and Path(published[-1]["path"]) == saved
    assert {v["framework"] for v in published} == {framework}
    # a flipped byte in the newest: verify says so, and the resume uses the one before it
    flip_a_byte(saved)
    bad = ckptrun("verify", str(ckpts), cwd=tmp_path)
    assert bad.returncode == 1 and "corrupt" in bad.stdout, bad.stdout
    previous = max(v["step"] for v in published if Path(v["path"]) != saved)
    resumed = ckptrun("resume", "--latest", "--run-dir", str(run_dir), cwd=tmp_path, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert started_at(run_dir, 3) == previous
    assert f"skipping checkpoint {saved.name}" in (run_dir / "logs" / "attempt-3" / "console.log").read_text()
    assert one(run_dir, "run_completed")["step"] == STEPS
    assert_no_processes(run_dir, within=10)


def test_importing_ckptrun_never_imports_a_framework() -> None:
    """The integrations are optional: the CLI and the runtime's facade load neither Lightning nor transformers."""
    code = ("import sys, ckptrun.runtime, ckptrun.cli.main, ckptrun.runtime.checkpoint.framework_files; "
            "print(sorted(m for m in ('lightning', 'transformers', 'pytorch_lightning', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_checkpoint_is_trusted_only_once_its_manifest_commits(tmp_path: Path) -> None:
    """A file without a manifest (a kill before the commit) is never resumed from; sizes and digests are checked."""
    first, second, torn = tmp_path / "step=5.ckpt", tmp_path / "step=10.ckpt", tmp_path / "step=15.ckpt"
    for path, step in ((first, 5), (second, 10)):
        path.write_bytes(bytes(range(256)) * (step + 1))
        framework_files.publish(path, "lightning", "run", step)
    torn.write_bytes(b"half a checkpoint")
    assert framework_files.newest_verified(tmp_path, say=lambda _: None) == (second, 10)
    second.write_bytes(second.read_bytes()[:-1] + b"\x00")  # same size, one byte changed
    said: list[str] = []
    assert framework_files.newest_verified(tmp_path, say=said.append) == (first, 5)
    assert "digest mismatch" in said[0]
    statuses = {Path(str(v["path"])).name: v["status"] for v in framework_files.report(tmp_path)}
    assert statuses == {"step=5.ckpt": "ok", "step=10.ckpt": "corrupt", "step=15.ckpt": "unpublished"}
    framework_files.remove(first)
    assert not first.exists() and not framework_files.manifest_path_of(first).exists()
