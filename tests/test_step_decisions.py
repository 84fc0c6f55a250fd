"""Issue 13 item 1: the ranks' shared facts travel one step late, and every rank acts on them at the same step.

Step k's facts (loss, stop, save, save budget) are summed by an all-reduce that step k
starts and step k+1 reads. Two real gloo ranks check the agreement (same sums, same step,
a mean loss equal bit for bit to the synchronous one); one in-process run checks where the
decisions land: a save asked at step k happens at step k+1's boundary, step k's metrics
line is written once its sum is read, and ``finish`` writes the last one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from socket import socket

import pytest
import torch

from ckptrun.runtime import store
from ckptrun.runtime.env import RunEnv
from ckptrun.runtime.policies import SaveCadence
from ckptrun.runtime.precision import Policy, resolve
from ckptrun.runtime.records import read_events, read_metrics
from ckptrun.runtime.session import Run
from launch_helpers import FIXTURES, kill_tree

STEPS = 6


def _facts(rank: int, step: int) -> dict:
    """As tests/fixtures/exchange_ranks.py: rank 1 asks to stop during step 3, rank 0's clock to save during step 2."""
    return {"loss": 1.0 / (3 + rank + step), "stop": rank == 1 and step == 3, "save": rank == 0 and step == 2}


@pytest.mark.timeout(120)
def test_two_ranks_read_the_same_facts_one_step_late(tmp_path):
    with socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, str(FIXTURES / "exchange_ranks.py")]
    ranks = [subprocess.Popen([*command, str(rank), str(port), str(tmp_path), str(STEPS)], start_new_session=True)
             for rank in (0, 1)]
    try:
        assert [rank.wait(timeout=90) for rank in ranks] == [0, 0]
    finally:
        for rank in ranks:
            kill_tree(rank.pid)
    rank0, rank1 = (json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1))
    assert rank0 == rank1, "every rank acts on the same facts at the same step"
    assert [(row[0], row[1]) for row in rank0] == [(s, s - 1) for s in range(2, STEPS + 1)] + [("finish", STEPS)]
    for _, step, loss, stop, save in rank0:
        summed = torch.tensor([_facts(0, step)["loss"]], dtype=torch.float64) + _facts(1, step)["loss"]
        assert loss == summed.item() / 2, "the mean loss is the synchronous all-reduce's, bit for bit"
        assert (stop, save) == (step == 3, step == 2)


def _run(tmp_path: Path) -> Run:
    env = RunEnv(run_id="decisions", run_dir=tmp_path / "run", precision="fp32", async_save=False)
    run = Run(env, {}, Policy(resolve("fp32")))
    store.ensure_lineage(run.ckpt_dir, env.run_id)
    return run


def test_a_save_asked_during_step_k_lands_at_step_k_plus_1_and_lines_follow_their_sums(tmp_path):
    run = _run(tmp_path)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run.track(model=model, optimizer=optimizer)
    batches = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(STEPS)]
    lines_when_step_ended = []
    for x, y in run.batches(batches, steps=STEPS):
        # rank 0's clock asks for a save during step 2 only
        run.cadence = SaveCadence(every_seconds=1e-9 if run.step + 1 == 2 else None)
        run.train_step([(x, y)], forward=lambda batch: model(batch[0]),
                       loss=lambda out, batch: torch.nn.functional.mse_loss(out, batch[1]))
        lines_when_step_ended.append([r["step"] for r in read_metrics(run.run_dir)])
    run.finish()
    saved = [e["step"] for e in read_events(run.run_dir, "snapshot_saved")]
    assert saved == [3, STEPS], "asked during step 2, agreed when step 3 ended, saved at step 3's boundary (then the final one)"
    # a line waits for its step's sum (read when the next step ends); the save at step 3's boundary reads step 3's first
    assert lines_when_step_ended == [[], [1], [1, 2], [1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4, 5]]
    assert [r["step"] for r in read_metrics(run.run_dir)] == list(range(1, STEPS + 1)), "finish writes the last line"
