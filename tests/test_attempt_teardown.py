"""A failed attempt's tree is torn down without waiting the stop grace period, with no orphan left.

Real processes: a stand-in for torchrun that ignores SIGTERM and starts a "rank" that ignores it too (as a
rank blocked in a collective with a handler would), both carrying the run's id.
"""

from __future__ import annotations

import os
import sys
import time

import pytest

from ckptrun.cli.supervision.attempt import RUN_ID_VARIABLE, AttemptProcess, processes_of_run

STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c",
                          "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"],
                         stdout=sys.stdout)
time.sleep(600)
"""


def stubborn_tree(tmp_path, run_id: str) -> AttemptProcess:
    attempt = AttemptProcess([sys.executable, "-c", STUBBORN], {**os.environ, RUN_ID_VARIABLE: run_id},
                             tmp_path / "console.log")
    deadline = time.monotonic() + 30
    while "up" not in (tmp_path / "console.log").read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(processes_of_run(run_id)) == 2
    return attempt


@pytest.mark.timeout(120)
def test_failed_attempt_survivors_are_killed_after_the_short_grace_not_the_stop_grace(tmp_path) -> None:
    run_id = f"teardown-test-{os.getpid()}"
    attempt = stubborn_tree(tmp_path, run_id)
    attempt.teardown(grace=3600, run_id=run_id, failed=True)  # the stop grace would outlast the test's timeout
    assert attempt.exit_code() is not None and processes_of_run(run_id) == []


@pytest.mark.timeout(120)
def test_a_stop_keeps_its_grace_then_kills_every_survivor(tmp_path) -> None:
    run_id = f"teardown-stop-{os.getpid()}"
    attempt = stubborn_tree(tmp_path, run_id)
    took = attempt.teardown(grace=2, run_id=run_id)
    assert took >= 2, "the survivors ignore SIGTERM: a stop waits its whole grace before SIGKILL"
    assert attempt.exit_code() is not None and processes_of_run(run_id) == []
