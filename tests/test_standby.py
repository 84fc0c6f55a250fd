"""The warm standby agent and warm workers end to end: restarts are exact, ten in a row succeed, nothing outlives its run.

A standby is the next attempt's agent, started while an attempt trains and given its word on a restart
(``cli/supervision/standby.py``); warm workers are ranks forked from the agent, past ``import torch``
(``runtime/worker/warm_start.py``). One rank where ranks are not the point. Timings are never asserted: how much
faster it restarts lives in ``bench/peer_restart.py``.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import psutil
import pytest
from launch_helpers import (ONE_RANK_JOB, ONE_RANK_STEPS, Cleanup, alive, assert_losses_equal, assert_no_processes,
                            ckptrun, events, one, run_id, start, tail, wait_for)

from ckptrun.cli.supervision.attempt import WARM_PIDS
from ckptrun.cli.supervision.standby import STANDBY_MODULE
from ckptrun.runtime.records import final_losses

pytestmark = pytest.mark.e2e
RESTARTS = 10
STEPS = 2 * RESTARTS + 4
assert STEPS == ONE_RANK_STEPS  # conftest's reference run is this job
FLAGS = ["--nproc-per-node", "1", "--save-every-steps", "2", "--heartbeat-timeout", "5", "--startup-timeout", "60",
         "--restart-backoff", "0", "--max-restarts", str(RESTARTS), "--max-stalled-restarts", str(RESTARTS)]
JOB = ONE_RANK_JOB


@pytest.fixture(scope="module")
def reference(one_rank_job_run: Path) -> dict[int, float]:
    """The uninterrupted run's losses, every rank a new interpreter (``--no-warm-workers``): a cold start's bits
    (conftest's one-rank run of this job, shared with test_memory_tier)."""
    assert not (one_rank_job_run / "logs" / "attempt-1" / WARM_PIDS).exists()
    return final_losses(one_rank_job_run)


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


def warm_ranks(run_dir: Path, attempt: int) -> dict[int, int]:
    """Rank → pid of the attempt's forked ranks, from their pid files (empty: the ranks were not forked)."""
    folder = run_dir / "logs" / f"attempt-{attempt}" / WARM_PIDS
    return {facts["rank"]: facts["pid"] for facts in (json.loads(p.read_text()) for p in folder.glob("rank-*.json"))}


def pid_alive(pid: int) -> bool:
    try:
        return alive(psutil.Process(pid))
    except psutil.Error:
        return False


def kill_every_attempt(restarts: int) -> str:
    """Attempt k dies after step 2k + 1: it resumed from step 2k - 2 or later, saved at 2k, then is killed."""
    return ";".join(f"kill:rank=0:step={2 * k + 1}:attempt={k}" for k in range(1, restarts + 1))


@pytest.mark.timeout(300)
def test_ten_restarts_in_a_row_through_the_standby_and_warm_workers_are_exact(
        reference: dict[int, float], tmp_path: Path, cleanup: Cleanup) -> None:
    run_dir = cleanup.run_dir(tmp_path / "runs" / "faulty")
    result = ckptrun("launch", *FLAGS, "--name", "faulty", "--inject-fault", kill_every_attempt(RESTARTS), *JOB,
                     cwd=tmp_path, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    restarts = events(run_dir, "restart")
    assert len(restarts) == RESTARTS and len(events(run_dir, "attempt_start")) == RESTARTS + 1
    used = events(run_dir, "standby_used")
    assert [e["attempt"] for e in used] == list(range(2, RESTARTS + 2)), used  # every restart went through one
    assert all(warm_ranks(run_dir, attempt) for attempt in range(1, RESTARTS + 2))  # every attempt's rank was forked
    assert all(r["resume_verdict"] == "exact" for r in restarts), [r.get("resume_verdict") for r in restarts]
    assert_losses_equal(run_dir, reference)  # forked ranks compute the cold start's bits
    assert not standbys(run_dir)  # the one pre-started for a 12th attempt was dismissed at the end
    assert_no_processes(run_dir)


@pytest.mark.timeout(200)
def test_without_warm_workers_restarts_through_the_standby_are_exact(
        reference: dict[int, float], tmp_path: Path, cleanup: Cleanup) -> None:
    run_dir = cleanup.run_dir(tmp_path / "runs" / "spawned")
    result = ckptrun("launch", *FLAGS, "--no-warm-workers", "--name", "spawned", "--inject-fault", kill_every_attempt(1),
                     *JOB, cwd=tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [e["attempt"] for e in events(run_dir, "standby_used")] == [2]
    assert not any(warm_ranks(run_dir, attempt) for attempt in (1, 2))
    assert_losses_equal(run_dir, reference)
    assert_no_processes(run_dir)


@pytest.mark.timeout(200)
def test_a_hung_warm_rank_is_dumped_and_killed_and_a_sigkilled_supervisor_leaves_nothing(
        tmp_path: Path, cleanup: Cleanup) -> None:
    """Attempt 1 hangs: its forked rank's stack is dumped into its log and it is killed. Attempt 2's rank is
    forked from the standby, whose /proc environment is not the attempt's; SIGKILLing the supervisor then
    leaves neither that rank nor the standby pre-started for attempt 3."""
    run_dir = cleanup.run_dir(tmp_path / "runs" / "orphan")
    log = tmp_path / "orphan.log"
    process = cleanup.track(start("launch", *FLAGS, "--name", "orphan", "--inject-fault", "hang:rank=0:step=3:attempt=1",
                                  "--", "--steps", "100000", "--num-workers", "1", "--hidden", "128",
                                  cwd=tmp_path, log=log))
    wait_for(lambda: (run_dir / "events.jsonl").exists() and events(run_dir, "restart"), timeout=120,
             what=f"the hang to be detected and the run restarted: {log}")
    failure = one(run_dir, "failure")
    assert failure["cause"] == "hang" and failure["attempt"] == 1, failure
    stack = (run_dir / "logs" / "attempt-1" / "rank-0" / "stderr.log").read_text()
    assert "most recent call first" in stack and "fault_injection.py" in stack  # the hung rank's own stack
    hung = warm_ranks(run_dir, 1)[0]
    assert not pid_alive(hung)
    ranks = wait_for(lambda: warm_ranks(run_dir, 2), timeout=60, what="attempt 2's forked rank")
    ready = run_dir / "logs" / "standby.log"  # attempt 2's standby said it once, the one for attempt 3 says it again
    wait_for(lambda: tail(ready).count("ckptrun standby: ready") >= 2, timeout=90, what=f"a standby for attempt 3: {log}")
    waiting = standbys(run_dir)  # it, attempt 2's agent (once a standby) and what that forked: the same command line
    family = [psutil.Process(pid) for pid in ranks.values()]
    family += [child for rank in family for child in rank.children(recursive=True)]  # its data-loader worker
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=10)
    wait_for(lambda: not any(alive(p) for p in family + waiting), timeout=20, what="the forked rank and the standby to exit")
    # forked processes show the standby's command line: a loader worker started after `family` was read goes too
    wait_for(lambda: not standbys(run_dir), timeout=20, what=f"every process forked from the standby to exit: {log}")
    assert_no_processes(run_dir, within=20)


@pytest.mark.timeout(150)
def test_a_warm_rank_records_its_exception_and_may_leave_with_os_exit(tmp_path: Path, cleanup: Cleanup) -> None:
    """The bootstrap's error file survives torch's ``@record`` around a forked rank; ``os._exit(0)`` is a success
    (torch's fork start waits for a return value that such a rank never sends: warm_start.py posts it)."""
    (tmp_path / "boom.py").write_text("raise RuntimeError('boom in a forked rank')\n")
    (tmp_path / "quiet.py").write_text("import os, sys\nprint('leaving quietly', flush=True)\nos._exit(0)\n")
    run_dir = cleanup.run_dir(tmp_path / "runs" / "boom")
    result = ckptrun("launch", *FLAGS, "--name", "boom", "boom.py", cwd=tmp_path, timeout=120)
    assert result.returncode == 4 and "RuntimeError: boom in a forked rank" in result.stderr, result.stderr[-3000:]
    failure = one(run_dir, "failure")
    assert (failure["exception"], failure["phase"], failure["uses_runtime"]) == (
        "RuntimeError: boom in a forked rank", "run", False), failure
    assert warm_ranks(run_dir, 1)
    quiet = cleanup.run_dir(tmp_path / "runs" / "quiet")
    result = ckptrun("launch", *FLAGS, "--name", "quiet", "quiet.py", cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert warm_ranks(quiet, 1) and not events(quiet, "failure")
    assert_no_processes(run_dir)
    assert_no_processes(quiet)
