"""`ckptrun launch` end to end: real torchrun, 2 CPU ranks, the embedded default job, injected faults.

Scenarios are rows of a table. Every recovered run must end with per-step losses bitwise equal to an
uninterrupted reference run's (same args, same world size), and after every scenario no process
carrying the run's id may be left. Reference runs are shared per session.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pytest
from launch_helpers import (COMMON, FIXTURES, Cleanup, assert_losses_equal, assert_no_processes, ckptrun, events,
                            last_step, one, run_processes, start, tail, wait_for)

from ckptrun.cli.supervision.recovery import STARTUP_PARTS
from ckptrun.runtime.records import final_losses, read_metrics
from ckptrun.runtime.checkpoint.verify import verify_dir

pytestmark = pytest.mark.e2e
JOB_STEPS = 30  # the default job's length
# A run stopped mid-way sleeps in each save hook of attempts 1 and 2 (slow-save fires on the attempts named and never
# touches the losses): a save every 5 steps then takes seconds however fast the machine, so each stop lands
# before the job's end; the last resume (attempt 3) runs at full speed.
SLOWED = ["--inject-fault", "slow-save:ms=500;slow-save:ms=500:attempt=2"]


@pytest.fixture
def cleanup() -> Iterator[Cleanup]:
    """Kills every background CLI process tree and every process of the test's runs afterwards."""
    tracker = Cleanup()
    yield tracker
    tracker.close()


@pytest.fixture(scope="session")
def reference(default_job_run: Path) -> dict[int, float]:
    """The default job, 30 steps, uninterrupted (conftest's run, shared with test_exactness)."""
    return final_losses(default_job_run)


# --- recovered scenarios: faults, one restart each, exact losses ---------------------


@dataclass(frozen=True)
class Scenario:
    id: str
    fault: str
    failures: list[dict[str, Any]]  # fields each failure event must have, in order
    options: tuple[str, ...] = ()
    # the step of the save each kill fires in: a background persist may still run while training goes on,
    # so the failure's step is at least that save's and at most the job's last step
    save_steps: tuple[int, ...] = ()
    # failure index -> the step its rank hung after: a hung rank is silent, so the failure's step is the last one
    # the ranks shared (at most the hang's, and perhaps the snapshot's own)
    hang_steps: dict[int, int] = field(default_factory=dict)


EACH_SAVE_PHASE = ";".join([  # one run, one save phase per attempt (each attempt still makes progress)
    "kill-during-save:rank=1:phase=stage:step=10",
    "kill-during-save:rank=1:phase=persist:step=15:attempt=2",
    "kill-during-save:rank=0:phase=before-manifest:step=20:attempt=3",
    "kill-during-save:rank=0:phase=before-publish:step=25:attempt=4",
])
EXIT_KILL_HANG = ";".join([  # one run, one kind of failure per attempt
    "exit:rank=1:step=13:code=3",  # a rank exits with code 3 (restored from 10)
    "kill:rank=1:step=17:attempt=2",  # a rank is SIGKILLed (restored from 15)
    "hang:rank=0:step=22:attempt=3",  # a rank hangs, alive and silent
])
RECOVERED = [
    Scenario("exit-code-3-kill-rank1-hang-rank0", EXIT_KILL_HANG,
             [{"cause": "crash", "rank": 1, "exit_code": 3, "step": 13},
              {"cause": "crash", "rank": 1, "signal": "SIGKILL", "step": 17},
              {"cause": "hang", "suspect": 0}], ("--max-restarts", "3"), hang_steps={2: 22}),
    Scenario("kill-in-each-save-phase", EACH_SAVE_PHASE,
             [{"cause": "crash", "rank": r, "signal": "SIGKILL"} for r in (1, 1, 0, 0)], ("--max-restarts", "4"),
             save_steps=(10, 15, 20, 25)),
]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("scenario", RECOVERED, ids=[s.id for s in RECOVERED])
def test_recovers_exactly(scenario: Scenario, reference: dict[int, float], tmp_path: Path, cleanup: Cleanup) -> None:
    run_dir = cleanup.run_dir(tmp_path / "runs" / scenario.id)
    result = ckptrun("launch", *COMMON, *scenario.options, "--name", scenario.id, "--inject-fault", scenario.fault,
                     cwd=tmp_path, timeout=170)
    assert result.returncode == 0, result.stderr[-3000:]
    failures, restarts = events(run_dir, "failure"), events(run_dir, "restart")
    assert [{k: f.get(k) for k in expected} for f, expected in zip(failures, scenario.failures)] == scenario.failures
    assert len(failures) == len(scenario.failures) == len(restarts)
    for index, (failure, restart) in enumerate(zip(failures, restarts)):
        hang = index in scenario.hang_steps
        # the newest snapshot published before the failure (saves run in the background: not always the last due)
        # (a hung rank is silent: the step the ranks last shared may be the snapshot's own)
        assert restart["snapshot_step"] == newest_published_before(run_dir, failure["time"])
        assert restart["snapshot_step"] < failure["step"] or (hang and restart["snapshot_step"] == failure["step"])
        assert restart["lost_steps"] == failure["step"] - restart["snapshot_step"]
        assert failure["step"] <= min(JOB_STEPS, scenario.hang_steps.get(index, JOB_STEPS)), failure
        if scenario.save_steps:
            assert failure["step"] >= scenario.save_steps[index], failure
        startup = [part for _, part in STARTUP_PARTS]  # each worker milestone was noted, in order
        for part in ("detect_s", "teardown_s", "verify_s", "relaunch_to_first_step_s", "restore_s", *startup):
            assert restart.get(part) is not None and restart[part] >= 0, (part, restart)
        if hang:
            # every rank goes silent within milliseconds of the hang: whichever crossed the timeout first is
            # "stale"; the suspect is picked among all live ranks, as the one not waiting inside torch
            assert failure["stale_ranks"] and set(failure["stale_ranks"]) <= set(failure["stacks_dumped"]), failure
            assert failure["suspect"] in failure["stacks_dumped"], failure
            assert failure["waiting_on_peers"][str(failure["suspect"])] is False, failure
            rank_log = run_dir / "logs" / f"attempt-{index + 1}" / f"rank-{failure['suspect']}" / "stderr.log"
            stack = tail(rank_log, 20000)  # the hung rank's own stack, dumped before it was killed
            assert "most recent call first" in stack and "_fire" in stack, stack[-2000:]
    assert len(events(run_dir, "attempt_start")) == len(restarts) + 1
    assert_losses_equal(run_dir, reference)
    reports = verify_dir(run_dir / "checkpoints")
    assert reports and all(r.ok for r in reports if r.status != "in-progress"), [r.to_json() for r in reports]
    assert_no_processes(run_dir)


def newest_published_before(run_dir: Path, time: float) -> int | None:
    steps = [e["step"] for e in events(run_dir, "snapshot_saved") if e["time"] < time]
    return max(steps, default=None)


# --- runs that end without recovering ------------------------------------------------


@pytest.mark.timeout(60)
def test_syntax_error_is_not_retried(tmp_path: Path, cleanup: Cleanup) -> None:
    run_dir = cleanup.run_dir(tmp_path / "runs" / "syntax")
    result = ckptrun("launch", *COMMON, "--name", "syntax", str(FIXTURES / "syntax_error.py"), cwd=tmp_path)
    assert result.returncode == 4, result.stderr
    assert "error: the script failed to load: rank " in result.stderr and "SyntaxError" in result.stderr
    assert "hint: " in result.stderr and "Traceback" not in result.stderr
    assert len(events(run_dir, "attempt_start")) == 1
    assert one(run_dir, "failure")["phase"] == "load"
    assert_no_processes(run_dir)


@pytest.mark.timeout(90)
def test_restart_budget_exhausted_exits_1(tmp_path: Path, cleanup: Cleanup) -> None:
    run_dir = cleanup.run_dir(tmp_path / "runs" / "budget")
    faults = "kill:rank=1:step=7;kill:rank=1:step=12:attempt=2"
    result = ckptrun("launch", *COMMON, "--name", "budget", "--max-restarts", "1", "--inject-fault", faults, cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert "restart budget is spent" in result.stderr
    assert len(events(run_dir, "restart")) == 1
    assert one(run_dir, "gave_up")["exit_code"] == 1 and len(events(run_dir, "failure")) == 2
    assert_no_processes(run_dir)


# --- stopping --------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_ckptrun_stop_then_sigterm_of_a_resume_from_an_older_snapshot_and_resume_latest_continue_exactly(
        reference: dict[int, float], tmp_path: Path, cleanup: Cleanup) -> None:
    """One run stopped twice. Attempt 1: a second launcher of its run dir is refused, `ckptrun stop` stops it
    (exit 3). Attempt 2, resumed from an older snapshot (the lineage forks there, the newer snapshots are kept
    aside, never used): SIGTERM stops it at a step boundary (exit 3). `resume --latest` continues from that very
    step (zero lost steps) and the losses are the uninterrupted run's."""
    run_dir = cleanup.run_dir(tmp_path / "runs" / "stopme")
    launcher = cleanup.track(start("launch", *COMMON, *SLOWED, "--name", "stopme", cwd=tmp_path, log=tmp_path / "launch.log"))
    wait_for(lambda: last_step(run_dir) >= 5, timeout=90, what="step 5")
    second = ckptrun("launch", *COMMON, "--run-dir", str(run_dir), cwd=tmp_path)
    assert second.returncode == 2 and f"in use by supervisor pid {launcher.pid}" in second.stderr, second.stderr
    stop = ckptrun("stop", str(run_dir), cwd=tmp_path, timeout=90)
    assert stop.returncode == 0, stop.stderr
    assert launcher.wait(timeout=60) == 3, tail(tmp_path / "launch.log")
    stopped_at = one(run_dir, "stopped")["step"]
    assert stopped_at < JOB_STEPS and not (run_dir / "stop").exists()
    assert_losses_equal(run_dir, reference, prefix=True)
    assert_no_processes(run_dir)

    older = min(e["step"] for e in events(run_dir, "snapshot_saved") if e["step"] < stopped_at and (Path(e["path"])).exists())
    resumed = cleanup.track(start("resume", "--from", str(older), "--run-dir", str(run_dir), cwd=tmp_path,
                                  log=tmp_path / "resume.log"))  # attempt 2: slowed too (SLOWED), so SIGTERM lands
    wait_for(lambda: attempt_steps(run_dir, 2), timeout=90, what="attempt 2's first step")
    resumed.send_signal(signal.SIGTERM)
    assert resumed.wait(timeout=60) == 3, tail(tmp_path / "resume.log")
    assert "forked a new lineage" in tail(tmp_path / "resume.log", 20000)
    assert one(run_dir, "resume")["snapshot_step"] == older
    assert list((run_dir / "checkpoints" / "abandoned").glob(f"*/step-{stopped_at:09d}"))
    stopped = events(run_dir, "stopped")[-1]
    assert stopped["step"] == max(attempt_steps(run_dir, 2)) < JOB_STEPS
    assert_no_processes(run_dir)

    result = ckptrun("resume", "--latest", cwd=tmp_path)  # the most recent run under runs/
    assert result.returncode == 0, result.stderr[-3000:]
    assert events(run_dir, "resume")[-1]["snapshot_step"] == stopped["step"]  # zero lost steps
    assert_losses_equal(run_dir, reference)
    assert_no_processes(run_dir)


def attempt_steps(run_dir: Path, attempt: int) -> list[int]:
    """The steps ``attempt`` logged."""
    return [int(r["step"]) for r in read_metrics(run_dir) if r.get("attempt") == attempt and "step" in r]


@pytest.mark.timeout(120)
def test_sigkill_of_the_supervisor_leaves_no_process(tmp_path: Path, cleanup: Cleanup) -> None:
    run_dir = cleanup.run_dir(tmp_path / "runs" / "orphan")
    endless = ["--", "--steps", "100000"]
    launcher = cleanup.track(start("launch", *COMMON, "--name", "orphan", *endless, cwd=tmp_path, log=tmp_path / "launch.log"))
    wait_for(lambda: last_step(run_dir) >= 5, timeout=90, what="step 5")
    assert len(run_processes(run_dir)) >= 3  # torchrun and two ranks, at least
    launcher.kill()
    launcher.wait()
    assert_no_processes(run_dir)
    logs = "".join(tail(p, 2000) for p in (run_dir / "logs" / "attempt-1").glob("*/attempt_0/*/stderr.log"))
    assert "is gone; exiting" in logs, logs  # the watchdog fired (torchrun may then end the other rank)


# A script that does not use the runtime, crashed and restarted from its own files: covered (with more)
# by test_plain_scripts.py::test_a_killed_rank_restarts_and_the_script_completes_from_its_own_file.
