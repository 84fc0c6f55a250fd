"""`ckptrun launch/resume/stop` refusals and the launch spec: fast, no training processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from snapshot_factory import make_snapshot

from ckptrun.cli.commands.launch import split_target
from ckptrun.cli.errors import CkptrunError
from ckptrun.cli.supervision.rundir import RunLock, RunPaths, latest_run
from ckptrun.cli.supervision.spec import LaunchSpec, RunRecord, build_spec, write_run_record
from ckptrun.runtime import records

CLI = [sys.executable, "-m", "ckptrun.cli.main"]


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("flags, message", [
    ({"nnodes": "0"}, "--nnodes 0: must be N >= 1 or MIN:MAX with 1 <= MIN <= MAX"),
    ({"nnodes": "3:1"}, "--nnodes 3:1: must be N >= 1 or MIN:MAX"),
    ({"nnodes": "x"}, "--nnodes x: must be N or MIN:MAX"),
    ({"heartbeat_timeout": "0"}, "--heartbeat-timeout 0: Input should be greater than 0"),
    ({"time_limit": "2x"}, "--time-limit 2x: '2x' is not a duration"),
    ({"nproc_per_node": "two"}, "--nproc-per-node two: must be a number of ranks"),
    ({"stop_signal": "SIGKILL"}, "--stop-signal SIGKILL: must be a catchable signal"),
    ({"inject_fault": "kill:rank=1"}, "--inject-fault kill:rank=1: fault 'kill:rank=1': needs step=S"),
])
def test_bad_flags_are_one_line_errors(flags: dict, message: str) -> None:
    with pytest.raises(CkptrunError) as caught:
        build_spec(flags)
    assert caught.value.message.startswith(message) and caught.value.exit_code == 2
    assert "\n" not in caught.value.message


def test_config_file_is_overridden_by_flags(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text('nproc-per-node = 2\nmax_restarts = 7\ntime_limit = "2h"\nargs = ["--steps", "40"]\n')
    spec = build_spec({"max_restarts": 1, "name": None}, config)
    assert (spec.nproc_per_node, spec.max_restarts, spec.time_limit, spec.script_args) == ("2", 1, 7200.0, ["--steps", "40"])


def test_config_file_errors_name_the_file_and_key(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text("heartbeat_timeout = -1\n")
    with pytest.raises(CkptrunError, match=r"run.toml: heartbeat_timeout = -1: Input should be greater than 0"):
        build_spec({}, config)
    config.write_text("heartbeat_timout = 5\n")
    with pytest.raises(CkptrunError, match=r"run.toml: unknown key 'heartbeat_timout'"):
        build_spec({}, config)
    with pytest.raises(CkptrunError, match="does not exist"):
        build_spec({}, tmp_path / "missing.toml")


@pytest.mark.parametrize("args, script, rest", [
    ([], None, []),
    (["--steps", "40"], None, ["--steps", "40"]),
    (["train.py", "--lr", "1"], Path("train.py"), ["--lr", "1"]),
])
def test_script_and_its_args(args: list[str], script: Path | None, rest: list[str]) -> None:
    assert split_target(args) == (script, rest)


def test_second_lock_is_refused_naming_the_holder(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path / "run")
    with RunLock(paths):
        with pytest.raises(CkptrunError, match=f"in use by supervisor pid {os.getpid()}") as caught:
            RunLock(paths).acquire()
        assert caught.value.exit_code == 2
    assert not paths.holder_file.exists()


def test_stale_lock_of_a_dead_supervisor_is_taken_over(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path / "run")
    paths.root.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    paths.holder_file.write_text(json.dumps({"pid": dead.pid, "start_time": 1.0}))
    lock = RunLock(paths).acquire()
    try:
        assert lock.took_over and lock.took_over["pid"] == dead.pid
        assert json.loads(paths.holder_file.read_text())["pid"] == os.getpid()
    finally:
        lock.release()


def test_launch_refusals_exit_2_before_anything_runs(tmp_path: Path) -> None:
    result = cli("launch", "--nnodes", "2", cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.startswith("error: --nnodes 2 needs the rendezvous endpoint"), result.stderr
    assert not (tmp_path / "runs").exists(), "a refused launch creates nothing"
    result = cli("launch", "missing.py", cwd=tmp_path)
    assert result.returncode == 2 and "training script missing.py does not exist" in result.stderr
    make_snapshot(tmp_path / "used" / "checkpoints", 1)
    result = cli("launch", "--run-dir", str(tmp_path / "used"), cwd=tmp_path)
    assert result.returncode == 2 and "already holds snapshots" in result.stderr and "hint: continue it with `ckptrun resume" in result.stderr
    assert not (tmp_path / "runs").exists()


def _run(tmp_path: Path, name: str) -> Path:
    run_dir = tmp_path / "runs" / name
    run_dir.mkdir(parents=True)
    write_run_record(run_dir, RunRecord(run_id=name, spec=LaunchSpec(run_dir=run_dir)))
    return run_dir


def test_resume_without_a_verified_snapshot_exits_2(tmp_path: Path) -> None:
    _run(tmp_path, "empty")
    result = cli("resume", "--latest", cwd=tmp_path)
    assert result.returncode == 2 and "no verified snapshot" in result.stderr and "hint: " in result.stderr


def test_resume_and_stop_pick_the_most_recent_run(tmp_path: Path) -> None:
    old, new = _run(tmp_path, "old"), _run(tmp_path, "new")
    os.utime(old / "run.json", (1, 1))
    os.utime(old, (1, 1))
    assert latest_run(tmp_path / "runs") == new
    result = cli("stop", cwd=tmp_path)
    assert result.returncode == 2 and "no supervisor is running runs/new" in result.stderr
    assert not (new / "stop").exists()


def _failed_run_with_a_fault(tmp_path: Path) -> Path:
    """A kill demo's run: two ranks, ``kill:rank=1:step=12`` stored, attempt 1 over (no snapshot here)."""
    run_dir = tmp_path / "runs" / "demo"
    run_dir.mkdir(parents=True)
    spec = LaunchSpec(run_dir=run_dir, nproc_per_node="2", inject_fault="kill:rank=1:step=12", script_args=["--steps", "9"])
    write_run_record(run_dir, RunRecord(run_id="demo", spec=spec))
    records.log_event(run_dir, "attempt_start", attempt=1)
    return run_dir


def test_a_stored_fault_that_can_no_longer_fire_does_not_block_a_resume_on_fewer_ranks(tmp_path: Path) -> None:
    """It is dropped in one line; a fault given on this resume that names a missing rank is still refused.
    (Both end at "no verified snapshot": the spec, its refusals and the command line come before it.)"""
    _failed_run_with_a_fault(tmp_path)
    resumed = cli("resume", "--latest", "--nproc-per-node", "1", "--allow-reshard", "--", "--lr", "1e-3", cwd=tmp_path)
    assert resumed.returncode == 2 and "no verified snapshot" in resumed.stderr, resumed.stderr
    assert ("ckptrun: dropping the stored --inject-fault that can no longer fire on this resume (attempt 2 on): "
            "kill:rank=1:step=12 (it fires on attempt 1 only)") in resumed.stderr.splitlines()
    assert "ckptrun: resuming the default job --steps 9 --lr 1e-3" in resumed.stderr  # the stored arguments kept
    explicit = cli("resume", "--latest", "--nproc-per-node", "1", "--allow-reshard", "--inject-fault",
                   "kill:rank=1:step=20:attempt=2", cwd=tmp_path)
    assert explicit.returncode == 2 and "--inject-fault names rank 1, but the world has ranks 0..0" in explicit.stderr
    assert "dropping the stored" not in explicit.stderr and "Traceback" not in explicit.stderr


def test_resume_outside_a_run_exits_2(tmp_path: Path) -> None:
    result = cli("resume", "--latest", cwd=tmp_path)
    assert result.returncode == 2 and "no runs under runs/" in result.stderr


@pytest.mark.parametrize("module", ["commands.launch", "supervision.runner", "supervision.world", "supervision.supervisor",
                                    "supervision.attempt", "supervision.failures", "commands.demo", "supervision.spec"])
def test_supervisor_side_imports_without_torch(module: str) -> None:
    code = f"import sys, ckptrun.cli.{module}; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "False", result.stderr


@pytest.mark.parametrize("given, told", [({}, "auto"), ({"require_exact_resume": True}, 1),
                                         ({"require_exact_resume": True, "decision_every_steps": 8}, 8)])
def test_an_exact_resume_run_shares_its_facts_every_step_unless_told_otherwise(given, told) -> None:
    """The exact-resume check needs the original line of every replayed step; a crash takes unshared lines."""
    from ckptrun.runtime.env import RunEnv

    env = RunEnv.from_env(RunEnv(**build_spec(given).worker_policy()).to_env())
    assert env.decision_every_steps == told
