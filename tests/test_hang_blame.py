"""The rank that hung is blamed (issue 23, item 4): every rank's stacks are dumped, not only the stale ones,
and the suspect is the rank that is not inside a collective — here rank 0 of a plain DDP script, whose peer
waits for it in DDP's all-reduce."""

from __future__ import annotations

from pathlib import Path

import pytest
from launch_helpers import COMMON, FIXTURES, Cleanup, assert_no_processes, ckptrun, one

SCRIPT = str(FIXTURES / "plain_ddp.py")


@pytest.mark.e2e
@pytest.mark.timeout(150)
def test_a_hung_rank_0_is_named_and_every_rank_shows_its_stack(tmp_path: Path, cleanup: Cleanup) -> None:
    run_dir, out = cleanup.run_dir(tmp_path / "runs" / "hang0"), tmp_path / "out"
    result = ckptrun("launch", *COMMON, "--grace-period", "5", "--name", "hang0", "--inject-fault", "hang:rank=0:step=4",
                     SCRIPT, "--out", str(out), "--steps", "8", cwd=tmp_path, timeout=140)
    assert result.returncode == 0, result.stderr[-3000:]
    failure = one(run_dir, "failure")
    assert failure["cause"] == "hang" and failure["stacks_dumped"] == [0, 1]
    for rank in (0, 1):
        stack = (run_dir / "logs" / "attempt-1" / f"rank-{rank}" / "stderr.log").read_text()
        assert "most recent call first" in stack and "plain_ddp.py" in stack, rank
    assert failure["waiting_on_peers"]["0"] is False  # rank 0 sits in the script's own code (the injected hang)
    assert failure["suspect"] == 0 and failure["rank"] == 0
    assert "suspect: rank 0" in result.stderr
    assert_no_processes(run_dir, within=5)
