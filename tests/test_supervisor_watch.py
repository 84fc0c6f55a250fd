"""A dead supervisor leaves nothing it started, whatever its ranks are doing — even when nobody reaps it.

A SIGKILLed supervisor whose parent has not waited for it yet is a zombie: it keeps its pid and create time.
The watches (every rank's and the torchrun wrapper's, :mod:`ckptrun.runtime.worker.liveness`) once took that for a
live supervisor, so a hung rank and its torchrun stayed forever (the orphan of a two-node run whose leader was
killed). Here the "supervisor" is a stand-in process the test kills and deliberately does not reap, and the
attempt is the real wrapper (``python -m ckptrun.cli.supervision.agent``, torchrun) with two ranks stuck where
no Python handler can help: rank 0 in C code holding the GIL (its own watch thread never runs), rank 1
blocked in a gloo barrier that rank 0 never reaches.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from launch_helpers import kill_tree, wait_for

from ckptrun.cli.supervision.attempt import processes_of_run
from ckptrun.runtime.env import RunEnv
from ckptrun.runtime.worker.liveness import supervisor_alive

STUCK = """
import os, re, sys
from pathlib import Path
import torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
Path(sys.argv[1], f"ready-{rank}").touch()
if rank == 0:
    re.match(r"(a+)+$", "a" * 64 + "b")  # exponential backtracking in C: holds the GIL for ages
else:
    dist.barrier()  # waits for rank 0, which never comes
"""


def test_a_zombie_supervisor_is_dead() -> None:
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    started = psutil.Process(stand_in.pid).create_time()
    assert supervisor_alive(stand_in.pid, started)
    stand_in.kill()
    wait_for(lambda: psutil.Process(stand_in.pid).status() == psutil.STATUS_ZOMBIE, timeout=20, what="a zombie")
    assert not supervisor_alive(stand_in.pid, started)  # not reaped, yet gone
    stand_in.wait()


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_an_unreaped_dead_supervisor_leaves_no_rank_in_c_code_or_in_a_collective(tmp_path: Path) -> None:
    run_id = f"watch-{os.getpid()}"
    (tmp_path / "stuck.py").write_text(STUCK)
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    env = RunEnv(run_id=run_id, run_dir=tmp_path, supervisor_pid=stand_in.pid,
                 supervisor_start_time=psutil.Process(stand_in.pid).create_time())
    command = [sys.executable, "-m", "ckptrun.cli.supervision.agent", str(tmp_path / "failures.json"), "--standalone",
               "--nproc-per-node", "2", "--max-restarts", "0", "-m", "ckptrun.runtime.worker.bootstrap",
               str(tmp_path / "stuck.py"), str(tmp_path)]
    with open(tmp_path / "agent.log", "wb") as log:
        agent = subprocess.Popen(command, env={**os.environ, **env.to_env()}, stdout=log, stderr=subprocess.STDOUT,
                                 cwd=tmp_path, start_new_session=True)
    try:
        wait_for(lambda: all((tmp_path / f"ready-{r}").exists() for r in (0, 1)), timeout=120, what="both ranks stuck")
        assert len(processes_of_run(run_id)) >= 3  # torchrun and two ranks
        stand_in.kill()  # and never waited for until the end: a zombie
        wait_for(lambda: agent.poll() is not None, timeout=60, what="the torchrun wrapper to exit")
        wait_for(lambda: not processes_of_run(run_id), timeout=30, what="every process of the run to exit")
        log = (tmp_path / "agent.log").read_text(errors="replace")
        assert "is gone; exiting" in log, log[-3000:]  # a watch fired (the wrapper's, or rank 1's first)
        assert psutil.Process(stand_in.pid).status() == psutil.STATUS_ZOMBIE  # the watches did not need it reaped
    finally:
        kill_tree(agent.pid)
        for process in processes_of_run(run_id):
            kill_tree(process.pid)
        stand_in.kill()
        stand_in.wait()
