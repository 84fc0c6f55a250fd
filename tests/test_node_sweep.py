"""The teardown sweep of one node matches (run id, node): another node's workers on the same host survive it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ckptrun.cli.supervision.attempt import kill_all, processes_of_run
from ckptrun.runtime.env import RunEnv


@pytest.mark.timeout(60)
def test_the_sweep_finds_only_its_own_nodes_workers() -> None:
    started = {}
    try:
        for node in (0, 1):
            env = {**os.environ, **RunEnv(run_id="sweep-r", node=node).to_env()}
            started[node] = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
        assert [p.pid for p in processes_of_run("sweep-r", node=1)] == [started[1].pid]
        assert sorted(p.pid for p in processes_of_run("sweep-r")) == sorted(p.pid for p in started.values())
        # a promoted spare's node sweeps its own rank and the label its standby (started before it had one) carries
        assert [p.pid for p in processes_of_run("sweep-r", node={"1", "spare-3"})] == [started[1].pid]
        assert processes_of_run("sweep-r", node={"spare-3"}) == []
        kill_all(processes_of_run("sweep-r", node=1))
        assert started[1].wait(timeout=20) is not None and started[0].poll() is None
    finally:
        for process in started.values():
            process.kill()
            process.wait()
