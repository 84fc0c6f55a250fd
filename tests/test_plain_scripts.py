"""Plain scripts (no ``ckptrun.runtime``) under `ckptrun launch`: zero-code supervision through the bootstrap.

The bootstrap registers torch's global optimizer-step hook, so a plain script's steps beat the heartbeat:
faults fire by step, hangs are detected with stack dumps, `status` lists its ranks, `stop` sends SIGTERM,
and the run never outlives a SIGKILLed supervisor. One fixture, ``plain_ddp.py``: a DDP script that
saves its own ``torch.save`` checkpoint every 5 steps and resumes from it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from launch_helpers import (COMMON, FIXTURES, PLAIN_EXIT_ALLOWANCE, Cleanup, assert_no_processes, ckptrun, events, one,
                            run_processes, start, tail, wait_for)

from ckptrun.runtime.worker.bootstrap import names_runtime
from ckptrun.runtime.env import variable
from ckptrun.runtime.records import read_heartbeats, read_metrics

SCRIPT = str(FIXTURES / "plain_ddp.py")
HEARTBEAT_TIMEOUT = 5.0  # COMMON's --heartbeat-timeout
GRACE = ["--grace-period", "5"]  # the fixture traps SIGTERM: a hung rank is killed after the grace period


def script_steps(out: Path) -> list[int]:
    """The steps the script itself logged (rank 0), in order, across attempts."""
    return [json.loads(line)["step"] for line in (out / "losses.jsonl").read_text().splitlines()]


def hook_step(run_dir: Path, rank: int) -> int:
    """The step of the rank's step-hook heartbeat (0 before its first optimizer step)."""
    beat = read_heartbeats(run_dir).get(rank)
    return beat.step if beat is not None and beat.source == "step-hook" else 0


# --- without ranks ----------------------------------------------------------------------------


def test_the_bootstrap_finds_a_runtime_import_anywhere_in_the_script() -> None:
    assert names_runtime(compile("import ckptrun.runtime as ckr\n", "s", "exec"))
    assert names_runtime(compile("def main():\n    from ckptrun import runtime\n", "s", "exec"))
    assert not names_runtime(compile("import torch\nimport ckptrun_other\n", "s", "exec"))


def bootstrap(script: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """One process through the worker bootstrap, as torchrun would start a rank, under a C1 environment."""
    path = tmp_path / "script.py"
    path.write_text(script)
    c1 = {variable("supervised"): "1", variable("run_dir"): str(tmp_path / "run"), variable("heartbeat_interval"): "60"}
    environ = {k: v for k, v in os.environ.items() if not k.startswith("CKPTRUN_")} | c1 | env
    return subprocess.run([sys.executable, "-m", "ckptrun.runtime.worker.bootstrap", str(path)], env=environ,
                          capture_output=True, text=True, timeout=120)


def test_a_script_without_torch_never_loads_it(tmp_path: Path) -> None:
    result = bootstrap("import sys\nprint('torch' in sys.modules)\n", tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stderr


@pytest.mark.parametrize("imports, uses_runtime", [("", False), ("import ckptrun.runtime as ckr\n", True)])
def test_an_early_exit_is_recorded_and_says_whether_the_script_uses_the_runtime(tmp_path: Path, imports: str,
                                                                                 uses_runtime: bool) -> None:
    error_file = tmp_path / "error.json"
    result = bootstrap(imports + "raise SystemExit(2)  # argparse's way, before init()\n", tmp_path,
                       TORCHELASTIC_ERROR_FILE=str(error_file))
    assert result.returncode == 2
    message = json.loads(error_file.read_text())["message"]
    assert message["message"] == "exited with code 2" and message["extraInfo"]["ckptrun_runtime"] is uses_runtime


STEPS = """
import torch
model = torch.nn.Linear(2, 1)
optimizers = [torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)]
{init}
for step in range(3):
    model(torch.ones(1, 2)).sum().backward()
    for optimizer in optimizers:  # two optimizers stepping together make one step
        optimizer.step()
"""


def test_the_step_hook_counts_steps_and_defers_to_the_runtime(tmp_path: Path) -> None:
    plain = bootstrap(STEPS.format(init=""), tmp_path)
    assert plain.returncode == 0, plain.stderr
    beat = read_heartbeats(tmp_path / "run")[0]
    assert (beat.source, beat.step, beat.phase) == ("step-hook", 3, "returned")  # throttled to 60 s: the exit beat has it
    failed = bootstrap(STEPS.format(init="") + "raise SystemExit(3)\n", tmp_path, **{variable("run_dir"): str(tmp_path / "failed")})
    assert failed.returncode == 3 and read_heartbeats(tmp_path / "failed")[0].phase == "done"  # it did not return
    assert [(r["step"], r["source"]) for r in read_metrics(tmp_path / "run")] == [(1, "step-hook"), (3, "step-hook")]
    adopted = bootstrap(STEPS.format(init="import ckptrun.runtime as ckr\nrun = ckr.init()"), tmp_path,
                        **{variable("run_dir"): str(tmp_path / "adopted")})
    assert adopted.returncode == 0, adopted.stderr
    assert read_heartbeats(tmp_path / "adopted")[0].source == "runtime"  # the hook stayed silent
    assert not read_metrics(tmp_path / "adopted")


def test_a_fault_on_a_rank_that_does_not_exist_is_refused(tmp_path: Path) -> None:
    result = ckptrun("launch", "--nproc-per-node", "2", "--inject-fault", "kill:rank=2:step=3", SCRIPT, "--out", "o", cwd=tmp_path)
    assert result.returncode == 2 and "rank 2" in result.stderr and "0..1" in result.stderr, result.stderr
    assert not (tmp_path / "runs").exists()


# --- end to end --------------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.timeout(90)
def test_a_bad_script_argument_fails_once_and_shows_the_argparse_error(tmp_path: Path, cleanup: Cleanup) -> None:
    run_dir = cleanup.run_dir(tmp_path / "runs" / "typo")
    result = ckptrun("launch", *COMMON, "--name", "typo", SCRIPT, "--out", str(tmp_path / "out"), "--stpes", "100", cwd=tmp_path)
    assert result.returncode == 4, result.stderr[-3000:]
    assert len(events(run_dir, "attempt_start")) == 1
    assert "error: unrecognized arguments: --stpes 100" in result.stderr
    assert "error: the first attempt failed before its first step" in result.stderr
    assert "runs/typo/logs/attempt-1/rank-" in result.stderr and "restart budget" not in result.stderr
    assert_no_processes(run_dir)


@pytest.mark.e2e
@pytest.mark.timeout(150)
def test_a_killed_rank_restarts_and_the_script_completes_from_its_own_file(tmp_path: Path, cleanup: Cleanup) -> None:
    run_dir, out = cleanup.run_dir(tmp_path / "runs" / "kill"), tmp_path / "out"
    faults = "kill:rank=1:step=7;kill-during-save:rank=0"
    result = ckptrun("launch", *COMMON, *PLAIN_EXIT_ALLOWANCE, "--name", "kill", "--inject-fault", faults, SCRIPT,
                     "--out", str(out), "--steps", "20", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("does not use ckptrun.runtime") == 1
    assert result.stderr.count("kill-during-save can never fire") == 1
    assert "attempt 2 (the script is relaunched: its step count will say whether it resumed)" in result.stderr
    assert "attempt 2: the script resumed from its own checkpoint at step 5" in result.stderr  # its optimizer's count
    failure, restart = one(run_dir, "failure"), one(run_dir, "restart")
    assert failure["rank"] == 1 and failure["signal"] == "SIGKILL" and failure["step"] == 7 and failure["plain_script"]
    assert restart["snapshot"] is None and (restart["resumed_step"], restart["lost_steps"]) == (5, 2)
    assert script_steps(out) == [*range(1, 8), *range(6, 21)]  # killed after 7, resumed from its own step-5 file
    assert_no_processes(run_dir)
    drawn = ckptrun("report", str(run_dir), "--json", cwd=tmp_path)  # throughput, failures, restarts; no loss
    assert drawn.returncode == 0, drawn.stderr
    summary = json.loads(drawn.stdout)["summary"]
    assert (summary["restarts"], summary["failures"], summary["final_loss"]) == (1, 1, None)


@pytest.mark.e2e
@pytest.mark.timeout(150)
def test_a_rank_that_aborts_in_teardown_after_the_script_returned_completes_the_run(tmp_path: Path,
                                                                                   cleanup: Cleanup) -> None:
    """#23 follow-up: rank 1 SIGABRTs in the interpreter's teardown after both ranks' scripts returned (a gloo
    thread does this at exit): the run completed — exit 0, said, not relaunched, each step run once. Before:
    counted as a crash, and the finished script was relaunched."""
    run_dir, out = cleanup.run_dir(tmp_path / "runs" / "teardown"), tmp_path / "out"
    result = ckptrun("launch", *COMMON, *PLAIN_EXIT_ALLOWANCE, "--name", "teardown", SCRIPT, "--out", str(out),
                     "--steps", "8", "--abort-at-exit", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "aborted").exists(), "rank 1 did abort"
    died = one(run_dir, "died_after_return")
    assert died["step"] == 8 and died["exit_code"] != 0, died
    assert "counted as completed, not relaunched" in result.stderr
    assert len(events(run_dir, "attempt_start")) == 1 and not events(run_dir, "restart")
    assert script_steps(out) == list(range(1, 9))
    assert_no_processes(run_dir)


@pytest.mark.e2e
@pytest.mark.timeout(150)
def test_a_hang_is_detected_with_stack_dumps_and_the_run_recovers(tmp_path: Path, cleanup: Cleanup) -> None:
    run_dir, out = cleanup.run_dir(tmp_path / "runs" / "hang"), tmp_path / "out"
    result = ckptrun("launch", *COMMON, *GRACE, "--name", "hang", "--inject-fault", "hang:rank=1:step=4", SCRIPT,
                     "--out", str(out), "--steps", "12", cwd=tmp_path, timeout=140)
    assert result.returncode == 0, result.stderr[-3000:]
    failure = one(run_dir, "failure")
    # a plain script's steps reach the supervisor through a throttled heartbeat (only the faulty rank's is forced):
    # the failure's step is the last one the ranks shared, at most the hang's, however slow the machine
    assert failure["cause"] == "hang" and 0 <= failure["step"] <= 4 and failure["plain_script"]
    if failure["waiting_on_peers"]["1"] is not None:  # rank 1's dump arrived within the stack wait (not on a loaded machine)
        assert failure["waiting_on_peers"]["1"] is False and failure["suspect"] == 1
    assert failure["detect_s"] > HEARTBEAT_TIMEOUT  # silent past the timeout; how much later depends on the load
    stack = (run_dir / "logs" / "attempt-1" / "rank-1" / "stderr.log").read_text()
    assert "most recent call first" in stack and "plain_ddp.py" in stack  # the hung rank's stack, in its log
    attempts = script_attempts(out)
    assert len(attempts) == 2 and attempts[0] == list(range(1, len(attempts[0]) + 1)), attempts
    assert attempts[0][-1] <= 4  # rank 0 logs a step, then waits on the hung rank in that step's all-reduce
    resumed_from = attempts[1][0] - 1  # the script's own checkpoint (every 5 steps), or none (step 0)
    assert resumed_from % 5 == 0 and resumed_from <= attempts[0][-1], attempts
    assert attempts[1] == list(range(resumed_from + 1, 13)), attempts
    assert_no_processes(run_dir)


def script_attempts(out: Path) -> list[list[int]]:
    """The steps the script logged (rank 0), one list per process that logged them (an attempt each)."""
    by_pid: dict[int, list[int]] = {}
    for line in (out / "losses.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_pid.setdefault(record["pid"], []).append(record["step"])
    return list(by_pid.values())


@pytest.mark.e2e
@pytest.mark.timeout(150)
def test_status_lists_the_ranks_and_stop_exits_3_when_the_script_exits_cleanly(tmp_path: Path, cleanup: Cleanup) -> None:
    run_dir, out = cleanup.run_dir(tmp_path / "runs" / "stop"), tmp_path / "out"
    launcher = cleanup.track(start("launch", *COMMON, *GRACE, "--name", "stop", SCRIPT, "--out", str(out),
                                   "--steps", "100000", "--step-time", "0.05", cwd=tmp_path, log=tmp_path / "launch.log"))
    wait_for(lambda: min(hook_step(run_dir, 0), hook_step(run_dir, 1)) >= 2, timeout=90, what="both ranks' step 2")
    status = ckptrun("status", str(run_dir), "--json", cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    document = json.loads(status.stdout)
    ranks = {row["rank"]: row for row in document["ranks"]}
    assert sorted(ranks) == [0, 1] and all(row["alive"] and row["pid"] > 0 and row["step"] >= 2 for row in ranks.values())
    assert document["plain_script"] and document["progress"]["step"] >= 1
    stop = ckptrun("stop", str(run_dir), cwd=tmp_path, timeout=90)
    assert stop.returncode == 0 and "cannot be asked to save" in stop.stderr, stop.stderr
    assert launcher.wait(timeout=60) == 3, tail(tmp_path / "launch.log")
    stopped = one(run_dir, "run_stopped")
    assert stopped["plain_script"] and not stopped["forced"]
    assert (out / "ckpt.pt").exists()  # the script saved on SIGTERM, its own way
    assert_no_processes(run_dir)


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_sigkill_of_the_supervisor_of_a_hung_plain_script_leaves_no_process(tmp_path: Path, cleanup: Cleanup) -> None:
    run_dir = cleanup.run_dir(tmp_path / "runs" / "orphan")
    never = ["--heartbeat-timeout", "300"]  # the hang is not detected: the supervisor dies first
    launcher = cleanup.track(start("launch", *COMMON, *never, "--name", "orphan", "--inject-fault", "hang:rank=1:step=3",
                                   SCRIPT, "--out", str(tmp_path / "out"), "--steps", "100000", "--step-time", "0.05",
                                   cwd=tmp_path, log=tmp_path / "launch.log"))
    wait_for(lambda: hook_step(run_dir, 1) >= 3, timeout=90, what="rank 1 to hang after step 3")
    assert len(run_processes(run_dir)) >= 3  # torchrun's wrapper and two ranks, at least
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    assert_no_processes(run_dir)


SYS_EXIT_MAIN = """
import sys

import torch
import torch.distributed as dist


def main():
    dist.init_process_group("gloo")
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())  # main() returns None: litgpt's entry point, and the common idiom
"""


@pytest.mark.e2e
@pytest.mark.timeout(150)
def test_a_script_ending_in_sys_exit_of_main_completes_under_warm_workers(tmp_path: Path, cleanup: Cleanup) -> None:
    """Issue 39 item 1: ``sys.exit(main())`` with main() returning None never completed under the default warm
    workers (both ranks said ``returned``, the supervisor waited for ever): torch's ``record()`` takes only
    ``SystemExit(0)`` as a return, so a forked rank leaving with ``SystemExit(None)`` never posted its result."""
    script = tmp_path / "train.py"
    script.write_text(SYS_EXIT_MAIN)
    run_dir = cleanup.run_dir(tmp_path / "runs" / "exit")
    result = ckptrun("launch", *COMMON, *PLAIN_EXIT_ALLOWANCE, "--name", "exit", str(script), cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith("ckptrun: run completed"), result.stderr[-1000:]
    assert len(events(run_dir, "attempt_start")) == 1 and events(run_dir, "run_completed")
    assert_no_processes(run_dir, within=10)
