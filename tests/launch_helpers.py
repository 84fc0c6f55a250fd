"""Helpers for end-to-end tests of `ckptrun launch`: run the CLI, wait on conditions, find a run's processes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import psutil

from ckptrun.cli.supervision.attempt import processes_of_run
from ckptrun.runtime.records import final_losses, read_events, read_metrics, same_float

CKPTRUN = [sys.executable, "-m", "ckptrun.cli.main"]
FIXTURES = Path(__file__).parent / "fixtures"
# Every e2e launch: 2 CPU ranks, a snapshot every 5 steps, hang after 5 s of silence in training,
# a generous start-up allowance for a loaded machine, a short back-off.
COMMON = ["--nproc-per-node", "2", "--save-every-steps", "5", "--heartbeat-timeout", "5",
          "--startup-timeout", "60", "--restart-backoff", "0.1"]
# For plain-script runs that are not about hangs: a plain script is silent from its last (throttled) step beat to
# the step hook's exit beat, and on a loaded machine its DDP and gloo teardown took over 5 s there once (called a
# hang, the completed attempt ran again).
PLAIN_EXIT_ALLOWANCE = ["--heartbeat-timeout", "30"]
# The one-rank job of conftest's ``one_rank_job_run``, the reference of test_standby and test_memory_tier.
ONE_RANK_STEPS = 24
ONE_RANK_JOB = ["--", "--steps", str(ONE_RANK_STEPS), "--num-workers", "0", "--hidden", "128"]


def ckptrun(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the CLI to completion (stdout and stderr captured as text)."""
    return subprocess.run([*CKPTRUN, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def start(*args: str, cwd: Path, log: Path) -> subprocess.Popen:
    """Start the CLI in the background, its output in ``log``."""
    stream = open(log, "wb")
    return subprocess.Popen([*CKPTRUN, *args], cwd=cwd, stdout=stream, stderr=subprocess.STDOUT)


def wait_for(condition: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    """Poll ``condition`` until it is truthy; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


def run_id(run_dir: Path) -> str:
    return json.loads((run_dir / "run.json").read_text())["run_id"]


def last_step(run_dir: Path) -> int:
    steps = [int(r["step"]) for r in read_metrics(run_dir) if "step" in r]
    return max(steps, default=0)


def events(run_dir: Path, name: str) -> list[dict[str, Any]]:
    return read_events(run_dir, name)


def one(run_dir: Path, name: str) -> dict[str, Any]:
    found = events(run_dir, name)
    assert len(found) == 1, f"expected one {name!r} event, found {len(found)}: {found}"
    return found[0]


def assert_losses_equal(run_dir: Path, reference: dict[int, float], prefix: bool = False) -> None:
    """The run's per-step losses (later attempts overriding replayed steps) equal the reference bitwise."""
    losses = final_losses(run_dir)
    expected = {s: v for s, v in reference.items() if s in losses} if prefix else reference
    assert sorted(losses) == sorted(expected), f"steps differ: {sorted(set(losses) ^ set(expected))}"
    differing = [s for s in expected if not same_float(losses[s], expected[s])]
    assert not differing, f"losses differ at steps {differing[:5]}: {[(losses[s], expected[s]) for s in differing[:3]]}"


def alive(process: psutil.Process) -> bool:
    """Still running and not a zombie (psutil's create-time check rules out a reused pid)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def run_processes(run_dir: Path) -> list[psutil.Process]:
    try:
        return processes_of_run(run_id(run_dir))
    except (OSError, ValueError, KeyError):
        return []


def assert_no_processes(run_dir: Path, within: float = 20.0) -> None:
    """No process carrying the run's id is left (given ``within`` seconds to go)."""
    wait_for(lambda: not run_processes(run_dir), timeout=within, what=f"the processes of {run_dir.name} to exit")


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (test cleanup)."""
    try:
        root = psutil.Process(pid)
        family = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in family:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    psutil.wait_procs(family, timeout=5)


class Cleanup:
    """Collects background processes and run dirs; kills everything that is left when the test ends."""

    def __init__(self) -> None:
        self.popens: list[subprocess.Popen] = []
        self.run_dirs: list[Path] = []

    def track(self, popen: subprocess.Popen) -> subprocess.Popen:
        self.popens.append(popen)
        return popen

    def run_dir(self, path: Path) -> Path:
        self.run_dirs.append(path)
        return path

    def close(self) -> None:
        for popen in self.popens:
            kill_tree(popen.pid)
            popen.wait()
        for run_dir in self.run_dirs:
            for process in run_processes(run_dir):
                kill_tree(process.pid)


def tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""

