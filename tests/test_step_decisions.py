"""Issue 13 item 1: the ranks share their step facts every N steps, and every rank acts on them at the same step.

The facts of steps k-N+1..k (losses, stop, time-based save, save budget) travel in one all-gather
that step k starts and step k+1 reads. Two real gloo ranks check the agreement (the mean losses
bit for bit those of a synchronous all-reduce per step, a stop asked on one rank taken at the same
step by both, at most N steps later); in-process runs check where the decisions land: a save asked
at step k happens at the boundary after its batch is read, a line is written once its batch is
read, a save or ``finish`` shares the open batch first, and ``auto`` settles on one N.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ckptrun.runtime.storage import store
from ckptrun.runtime.step.decisions import INTERVAL_S, MAX_EVERY, WARMUP_BATCHES, choose_every
from ckptrun.runtime.env import RunEnv
from ckptrun.runtime.step.precision import Policy, resolve
from ckptrun.runtime.records import read_events, read_heartbeats, read_metrics
from ckptrun.runtime.step.session import Run
from launch_helpers import FIXTURES, kill_tree
from ports import free_port

STEPS = 6


@pytest.mark.timeout(120)
def test_two_ranks_share_every_n_steps_with_the_sync_mean_and_stop_at_the_same_step(tmp_path):
    every, stop_at, steps = 3, 4, 12
    port = free_port()
    command = [sys.executable, str(FIXTURES / "exchange_ranks.py")]
    ranks = [subprocess.Popen([*command, str(rank), str(port), str(tmp_path), str(every), str(stop_at), str(steps)],
                              start_new_session=True) for rank in (0, 1)]
    try:
        assert [rank.wait(timeout=90) for rank in ranks] == [3, 3], "both ranks stop (exit 3) after an emergency snapshot"
    finally:
        for rank in ranks:
            kill_tree(rank.pid)
    rank0, rank1 = (json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1))
    stopped = rank0["stopped_at"]
    assert stopped == rank1["stopped_at"], "every rank takes the stop at the same step"
    assert stop_at <= stopped <= stop_at + 2 * every - 1
    assert stopped == 7, "asked in step 4: shared with steps 4-6 when step 6 ends, read when step 7 ends"
    assert {beat.step for beat in read_heartbeats(tmp_path).values()} == {stopped}
    assert [e["step"] for e in read_events(tmp_path, "stopped")] == [stopped]
    assert [e["step"] for e in read_events(tmp_path, "snapshot_saved")] == [stopped], "the emergency snapshot"
    lines = read_metrics(tmp_path)
    assert [m["step"] for m in lines] == list(range(1, stopped + 1)), "every line up to the snapshot's step, once"
    for line in lines:  # bit for bit: == on floats, the synchronous all-reduce's mean
        assert line["loss"] == rank0["reference"][str(line["step"])] == rank1["reference"][str(line["step"])]


def _run(tmp_path: Path, **options) -> Run:
    env = RunEnv(run_id="decisions", run_dir=tmp_path / "run", precision="fp32", async_save=False, **options)
    run = Run(env, {}, Policy(resolve("fp32")))
    store.ensure_lineage(run.ckpt_dir, env.run_id)
    return run


def _train(run: Run, steps: int, clock_due: range = range(0)) -> list[list[int]]:
    """A tiny model trained ``steps`` steps; rank 0's clock says a save is due during the steps ``clock_due``.
    Returns the metrics lines' steps as each step ended."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run.track(model=model, optimizer=optimizer)
    batches = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(steps)]
    lines_when_step_ended = []
    for x, y in run.batches(batches, steps=steps):
        run.cadence = replace(run.cadence, every_seconds=1e-9 if run.step + 1 in clock_due else None)
        run.train_step([(x, y)], forward=lambda batch: model(batch[0]),
                       loss=lambda out, batch: torch.nn.functional.mse_loss(out, batch[1]))
        lines_when_step_ended.append([r["step"] for r in read_metrics(run.run_dir)])
    run.finish()
    return lines_when_step_ended


def test_every_step_a_save_asked_during_step_k_lands_at_step_k_plus_1_and_lines_follow_their_sums(tmp_path):
    run = _run(tmp_path, decision_every_steps=1)
    lines_when_step_ended = _train(run, STEPS, clock_due=range(2, 3))
    saved = [e["step"] for e in read_events(run.run_dir, "snapshot_saved")]
    assert saved == [3, STEPS], "asked during step 2, agreed when step 3 ended, saved at step 3's boundary (then the final one)"
    # a line waits for its step's sum (read when the next step ends); the save at step 3's boundary reads step 3's first
    assert lines_when_step_ended == [[], [1], [1, 2], [1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4, 5]]
    assert [r["step"] for r in read_metrics(run.run_dir)] == list(range(1, STEPS + 1)), "finish writes the last line"


def test_every_3_steps_lines_come_per_batch_and_a_clock_save_waits_for_its_batch(tmp_path):
    run = _run(tmp_path, decision_every_steps=3)
    lines_when_step_ended = _train(run, 8, clock_due=range(2, 4))  # due from step 2: seen when step 3 shares
    saved = [e["step"] for e in read_events(run.run_dir, "snapshot_saved")]
    assert saved == [4, 8], "due during step 2, shared with steps 1-3, read when step 4 ended: saved at its boundary"
    # steps 1-3 are read when step 4 ends; the save at step 4's boundary shares step 4 at once; 5-7 are read at 8
    assert lines_when_step_ended == [[], [], [], [1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4],
                                     [1, 2, 3, 4, 5, 6, 7]]
    assert [r["step"] for r in read_metrics(run.run_dir)] == list(range(1, 9)), "finish shares and writes the rest"


def test_a_step_cadence_save_shares_the_open_batch_first(tmp_path):
    run = _run(tmp_path, decision_every_steps=32, save_every_steps=5)
    _train(run, 7)
    assert [e["step"] for e in read_events(run.run_dir, "snapshot_saved")] == [5, 7]
    assert [r["step"] for r in read_metrics(run.run_dir)] == list(range(1, 8))


def test_auto_settles_on_one_n_from_the_warm_up_batches(tmp_path):
    assert choose_every([INTERVAL_S / 4] * 8) == 4 and choose_every([INTERVAL_S * 2, INTERVAL_S]) == 1
    assert choose_every([1e-5]) == MAX_EVERY
    run = _run(tmp_path)  # auto: every step until the warm-up batches are read
    _train(run, WARMUP_BATCHES + 40)
    # the N chosen depends on this machine's step time (the rule itself is checked above): one N, within bounds
    assert 1 <= run.exchange.every <= MAX_EVERY
    events = read_events(run.run_dir, "decision_cadence")
    assert events and events[0]["step"] == WARMUP_BATCHES and events[-1]["every_steps"] == run.exchange.every
    assert [e["every_steps"] for e in events] == sorted(e["every_steps"] for e in events), "N never falls"
    assert [r["step"] for r in read_metrics(run.run_dir)] == list(range(1, WARMUP_BATCHES + 41))
