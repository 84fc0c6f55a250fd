"""The warm standby agent end to end: restarts through it are exact, ten in a row succeed, none outlives its run.

A standby is the next attempt's agent, started while an attempt trains and given its word on a restart
(``cli/supervision/standby.py``). One rank where ranks are not the point. Timings are never asserted:
how much faster it restarts lives in ``bench/peer_restart.py``.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Iterator

import psutil
import pytest
from launch_helpers import (Cleanup, assert_losses_equal, assert_no_processes, ckptrun, events, run_id, start, tail,
                            wait_for)

from ckptrun.cli.supervision.standby import STANDBY_MODULE
from ckptrun.runtime.records import final_losses

pytestmark = pytest.mark.e2e
RESTARTS = 10
STEPS = 2 * RESTARTS + 4
FLAGS = ["--nproc-per-node", "1", "--save-every-steps", "2", "--heartbeat-timeout", "5", "--startup-timeout", "60",
         "--restart-backoff", "0", "--max-restarts", str(RESTARTS), "--max-stalled-restarts", str(RESTARTS)]
JOB = ["--", "--steps", str(STEPS), "--num-workers", "0", "--hidden", "128"]


@pytest.fixture
def cleanup() -> Iterator[Cleanup]:
    tracker = Cleanup()
    yield tracker
    tracker.close()


def standbys(run_dir: Path) -> list[psutil.Process]:
    """The run's standby agents still waiting (named by the run id in their argv)."""
    rid, found = run_id(run_dir), []
    for process in psutil.process_iter():
        try:
            command = process.cmdline()
            if STANDBY_MODULE in command and rid in command and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except psutil.Error:
            continue
    return found


def alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def kill_every_attempt() -> str:
    """Attempt k dies after step 2k + 1: it resumed from step 2k - 2 or later, saved at 2k, then is killed."""
    return ";".join(f"kill:rank=0:step={2 * k + 1}:attempt={k}" for k in range(1, RESTARTS + 1))


@pytest.mark.timeout(300)
def test_ten_restarts_in_a_row_through_the_standby_are_exact(tmp_path: Path, cleanup: Cleanup) -> None:
    reference = cleanup.run_dir(tmp_path / "runs" / "reference")
    result = ckptrun("launch", *FLAGS, "--no-standby", "--name", "reference", *JOB, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not events(reference, "standby_used")

    run_dir = cleanup.run_dir(tmp_path / "runs" / "faulty")
    result = ckptrun("launch", *FLAGS, "--name", "faulty", "--inject-fault", kill_every_attempt(), *JOB,
                     cwd=tmp_path, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    restarts = events(run_dir, "restart")
    assert len(restarts) == RESTARTS and len(events(run_dir, "attempt_start")) == RESTARTS + 1
    used = events(run_dir, "standby_used")
    assert [e["attempt"] for e in used] == list(range(2, RESTARTS + 2)), used  # every restart went through one
    assert all(r["resume_verdict"] == "exact" for r in restarts), [r.get("resume_verdict") for r in restarts]
    assert_losses_equal(run_dir, final_losses(reference))
    assert not standbys(run_dir)  # the one pre-started for a 12th attempt was dismissed at the end
    assert_no_processes(run_dir, within=5)


@pytest.mark.timeout(180)
def test_a_sigkilled_supervisor_leaves_no_standby(tmp_path: Path, cleanup: Cleanup) -> None:
    run_dir = cleanup.run_dir(tmp_path / "runs" / "orphan")
    log = tmp_path / "orphan.log"
    process = cleanup.track(start("launch", *FLAGS, "--name", "orphan", "--", "--steps", "100000", "--num-workers", "0",
                                  cwd=tmp_path, log=log))
    waiting = wait_for(lambda: (run_dir / "run.json").exists() and standbys(run_dir), timeout=90,
                       what=f"a standby to be pre-started: {log}")
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=10)
    wait_for(lambda: not any(alive(p) for p in waiting), timeout=20, what="the standby to exit")
    assert not standbys(run_dir), tail(log)
    assert_no_processes(run_dir, within=20)
