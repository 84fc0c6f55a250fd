"""Good bytes are not good state (issue 24): what a run publishes, keeps and reports when its values go bad.

Runtime scripts on real ranks (torchrun, gloo, CPU) with faults from C1; pure checks as tables.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptrun.runtime.checkpoint.staging import first_nonfinite
from ckptrun.runtime.checkpoint.verify import verify_snapshot
from ckptrun.runtime.env import RunEnv
from ckptrun.runtime.manifest import read_manifest
from ckptrun.runtime.records import final_losses, read_events, read_fatal, read_metrics
from ckptrun.runtime.step.finite_watch import FiniteWatch, limit_for
from ckptrun.runtime.step.precision import Policy, resolve
from ckptrun.runtime.step.session import Run
from ckptrun.runtime.storage import store
from launch_helpers import kill_tree
from workers import run_job, shared_tensors
from ports import free_port

FIXTURES = Path(__file__).parent / "fixtures"
STATE_JOB = FIXTURES / "state_job.py"


def published(ckpt_dir: Path) -> dict[str, Path]:
    return {e.name: e.path for e in store.list_entries(ckpt_dir, include_abandoned=True) if e.kind == "published"}


# --- pure checks -----------------------------------------------------------------


def test_a_blow_up_is_k_non_finite_losses_in_a_row_and_a_save_after_one_is_refused():
    watch = FiniteWatch(limit_for(50))
    assert watch.limit == 3 and limit_for(2) == 2
    assert not watch.observe(1, 0.5) and watch.begin_save() is None
    assert watch.observe(2, math.nan), "the run's first non-finite loss"
    assert not watch.observe(3, math.inf) and not watch.blown_up()
    assert watch.begin_save() == 2 and watch.begin_save() is None, "refused once, for the window it saw"
    watch.observe(4, math.nan)
    assert watch.blown_up() and watch.final_nonfinite() == 4 and watch.first_nonfinite == 2
    watch.rolled_back()
    assert not watch.blown_up() and watch.final_nonfinite() is None and watch.first_nonfinite == 2


def test_a_non_finite_loss_within_k_steps_of_a_restore_blames_it_later_ones_do_not():
    watch = FiniteWatch(3, restored_step=15)
    watch.observe(16, 0.4)
    assert not watch.poisoned()
    watch.observe(18, math.nan)
    assert watch.poisoned()
    late = FiniteWatch(3, restored_step=15)
    late.observe(19, math.nan)
    assert not late.poisoned()


def test_the_staged_floats_check_names_the_first_non_finite_tensor_and_ignores_integers():
    tensors = {"a": torch.ones(4), "steps": torch.tensor([3]), "b": torch.tensor([1.0, math.inf]), "c": torch.ones(2)}
    assert first_nonfinite(tensors) == "non-finite values in b"
    tensors["b"] = torch.tensor([math.nan, 1.0], dtype=torch.bfloat16)
    assert first_nonfinite(tensors) == "non-finite values in b"
    large = {"a": torch.full((3,), 6e4, dtype=torch.float16), "b": torch.full((10**6,), 100.0, dtype=torch.bfloat16)}
    assert first_nonfinite({**large, "n": torch.empty(0)}) is None, "finite values whose 16-bit norm would overflow"


FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_the_staged_floats_check_is_exact_for_every_float_dtype(dtype):
    """NaN, +inf and -inf anywhere (first, middle of a big tensor, last) are found; finite values however large
    (the dtype's max, whose squares and sums overflow the dtype) never read as non-finite."""
    big = torch.full((3_000_001,), 0.5, dtype=dtype)
    huge = {"max": torch.full((1000,), torch.finfo(dtype).max, dtype=dtype),
            "min": torch.full((1001,), torch.finfo(dtype).min, dtype=dtype), "big": big}
    assert first_nonfinite(huge) is None, "finite values of the dtype's extremes"
    for bad in (math.nan, math.inf, -math.inf):
        for where in (0, big.numel() // 2, big.numel() - 1):
            poisoned = big.clone()
            poisoned[where] = bad
            assert first_nonfinite({**huge, "poisoned": poisoned}) == "non-finite values in poisoned", (bad, where)
    both = huge["max"].clone()
    both[[3, 7]] = torch.tensor([math.inf, -math.inf], dtype=dtype)  # the sum of the two is NaN, not finite
    assert first_nonfinite({"both": both}) == "non-finite values in both"


# --- real ranks ---------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_weights_that_blow_up_are_never_published_the_last_good_snapshot_survives_and_the_run_rolls_back(tmp_path):
    """Weights NaN after step 15 (save every 5, keep 2), default --on-anomaly: the save of step 15 is refused
    at stage (non-finite parameters), three NaN losses roll back to step 10, which retention never deletes,
    and the run completes finite. Before: exit 0 with NaN losses and only NaN snapshots left."""
    run_dir = tmp_path / "run"
    result = run_job(run_dir, nproc=2, script=STATE_JOB, args=("--steps", "30"), save_every_steps=5, keep_last=2,
                     fault="nan-after:step=15", timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    refused = read_events(run_dir, "save_refused")
    assert [(e["step"], e["cause"]) for e in refused] == [(15, "non-finite")], refused
    rollback = read_events(run_dir, "rollback")
    assert [(e["from_step"], e["to_step"]) for e in rollback] == [(18, 10)]
    snapshots = published(run_dir / "checkpoints")
    assert store.snapshot_name(10) in snapshots, f"the last good snapshot was deleted: {sorted(snapshots)}"
    assert verify_snapshot(snapshots[store.snapshot_name(10)]).ok
    for name, path in snapshots.items():
        bad = [key for key, t in shared_tensors(path).items() if t.is_floating_point() and not torch.isfinite(t).all()]
        assert not bad, f"{name} holds non-finite {bad[:3]}"
    losses = final_losses(run_dir)
    assert max(losses) == 30 and math.isfinite(losses[30])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("nproc, fault, rollbacks, words", [
    (2, "nan-recurring:step=12", [(15, 10, 1, 0.5)], "came back at the same step after rollback 1"),
    (1, ";".join(f"nan-after:step={s}:attempt=any" for s in (12, 17, 22, 27)),
     [(15, 10, 1, 0.5), (20, 15, 2, 0.25), (25, 20, 3, 0.125)], "after 3 rollback(s) in this run, --max-rollbacks 3"),
])
def test_a_blow_up_that_comes_back_after_a_rollback_ends_exit_4_counted_per_run_with_the_lr_lowered_cumulatively(
        tmp_path, nproc, fault, rollbacks, words):
    """Issue 38: weights NaN every time the run passes step 12 rolled back 6,692 times in 400 s, each rollback
    event saying ``rollbacks: 1`` (the counter came back with the snapshot's counters) and the LR factor applied
    to the restored LR (never compounding). Now the count is the run's: a blow-up at the step a rollback left
    stops at once (exit 4, the data or hyperparameters), blow-ups at new steps stop after --max-rollbacks, and
    the k-th rollback runs at factor**k of the unlowered rate."""
    run_dir = tmp_path / "run"
    result = run_job(run_dir, nproc=nproc, script=STATE_JOB, args=("--steps", "30"), save_every_steps=5, keep_last=2,
                     fault=fault, timeout=200)
    [fatal_record] = read_fatal(run_dir)  # torchrun says 1 for any failed rank: the supervisor ends on this record
    assert fatal_record["exit_code"] == 4 and result.returncode == (4 if nproc == 1 else 1), result.stderr[-3000:]
    events = read_events(run_dir, "rollback")
    assert [(e["from_step"], e["to_step"], e["rollbacks"], e["lr_scale"]) for e in events] == rollbacks
    fatal = fatal_record["reason"]
    assert words in fatal and f"step {rollbacks[-1][0] + (0 if nproc == 2 else 5)}" in fatal, fatal
    metrics = read_metrics(run_dir)
    unlowered = next(m["lr"] for m in metrics if m["step"] == 1)
    for _, to_step, _, scale in rollbacks:  # the step after each rollback's snapshot, replayed at factor**k
        replayed = [m["lr"] for m in metrics if m["step"] == to_step + 1][-1]
        assert math.isclose(replayed, unlowered * scale, rel_tol=1e-9), (to_step, replayed, unlowered, scale)


@pytest.mark.timeout(300)
def test_save_overlap_skip_with_one_slow_rank_completes_and_every_rank_skips_the_same_saves(tmp_path):
    """A save every step, rank 0's saves slowed: a save is skipped only when every rank's saver is busy (shared
    in the step exchange), every rank skips the same steps, and a skip is not a failed save. Before: rank 0
    skipped while rank 1 entered the save (deadlock), or 3 "failed" skips stopped the run with exit 1. Rank 0's
    writer is held after each outcome (slow-retention), so its saver is busy when rank 1's is not."""
    run_dir = tmp_path / "run"
    result = run_job(run_dir, nproc=2, script=STATE_JOB, args=("--steps", "60"), save_every_steps=1,
                     save_overlap="skip", fault="slow-save:rank=0:ms=5;slow-retention:rank=0:ms=40", timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    skipped = read_events(run_dir, "save_skipped")
    by_rank = {rank: sorted(e["step"] for e in skipped if e.get("rank") == rank) for rank in (0, 1)}
    assert by_rank[0] and by_rank[0] == by_rank[1], by_rank
    assert not read_events(run_dir, "save_failed")
    saved = [e["step"] for e in read_events(run_dir, "snapshot_saved")]
    assert saved[-1] == 60 and len(saved) > 2 and set(saved) & set(by_rank[0]) <= {60}, "a final save is never skipped"

    assert all(verify_snapshot(path).ok for path in published(run_dir / "checkpoints").values())


@pytest.mark.timeout(240)
def test_a_scripts_own_saves_go_through_the_same_agreement_as_the_cadences(tmp_path):
    """Issue 24 item 5: the script calls ``run.save()`` every 3 steps while the policy saves every 5 (async), so
    steps 15 and 30 are due twice. Every save is agreed by both ranks (no deadlock, none failed or skipped),
    lands on its step boundary once, publishes a snapshot that verifies, and the parent chain follows the
    saves in order on every rank (``saved_step`` moves at the same step everywhere)."""
    run_dir = tmp_path / "run"
    result = run_job(run_dir, nproc=2, script=STATE_JOB, args=("--steps", "30", "--own-save-every", "3"),
                     save_every_steps=5, keep_last=20, timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not read_events(run_dir, "save_failed") and not read_events(run_dir, "save_skipped")
    saved = [e["step"] for e in read_events(run_dir, "snapshot_saved")]
    due = sorted({s for s in range(1, 31) if s % 3 == 0 or s % 5 == 0})
    assert saved == due, saved
    snapshots = published(run_dir / "checkpoints")
    assert sorted(snapshots) == [store.snapshot_name(s) for s in due]
    assert all(verify_snapshot(path).ok for path in snapshots.values())
    parents = [read_manifest(snapshots[store.snapshot_name(s)]).parent for s in due]
    assert parents == [None] + [store.snapshot_name(s) for s in due[:-1]], parents


@pytest.mark.timeout(300)
def test_a_replica_nudged_by_one_ulp_is_caught_at_the_next_save_and_the_restart_is_bitwise_exact(tmp_path):
    """DDP, rank 1's weights one ulp off after step 15 (just before that step's save: a later optimizer step may round
    a one-ulp drift away, as bf16 autocast's gradients did on an AMX machine): the save of step 15 compares the ranks' replica digests,
    names rank 1 and the tensor (`replicas_diverged`), publishes nothing and exits 1 (restart); the next attempt
    restores 10, the last snapshot whose replicas agreed, and ends bitwise equal to an uninterrupted run.
    Before: never noticed, the replicas stayed apart to the end."""
    run_dir, reference_dir = tmp_path / "run", tmp_path / "reference"
    fields = dict(nproc=2, script=STATE_JOB, args=("--steps", "20"), save_every_steps=5, timeout=200)
    diverged = run_job(run_dir, fault="nudge-replica:rank=1:step=15", **fields)
    assert diverged.returncode != 0, diverged.stderr[-3000:]
    events = read_events(run_dir, "replicas_diverged")
    assert [(e["step"], e["ranks"]) for e in events] == [(15, [1])], events
    assert events[0]["tensor"].startswith("model.") and events[0]["suspect"] == []
    assert sorted(published(run_dir / "checkpoints")) == [store.snapshot_name(5), store.snapshot_name(10)]
    resumed = run_job(run_dir, attempt=2, **fields)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [Path(e["snapshot"]).name for e in read_events(run_dir, "restored")] == [store.snapshot_name(10)]
    assert run_job(reference_dir, **fields).returncode == 0
    got, want = final_losses(run_dir), final_losses(reference_dir)
    assert sorted(got) == sorted(want) and all(got[s].hex() == want[s].hex() for s in want)
    for rank in (0, 1):
        assert (run_dir / f"final-{rank}.json").read_text() == (reference_dir / f"final-{rank}.json").read_text()


@pytest.mark.timeout(150)
def test_replicas_that_diverge_before_any_snapshot_agreed_stop_at_once_there_is_nothing_to_go_back_to(tmp_path):
    """Issue 38: DDP, rank 1 nudged after step 5, just before the first save, which finds it. A restart would start over
    from nothing and meet the same fault, so it is exit 4 in the first attempt (the fatal record), saying so."""
    run_dir = tmp_path / "run"
    result = run_job(run_dir, nproc=2, script=STATE_JOB, args=("--steps", "10"), save_every_steps=5,
                     fault="nudge-replica:rank=1:step=5", timeout=120)
    [fatal] = read_fatal(run_dir)
    assert fatal["exit_code"] == 4 and "before any snapshot whose replicas agreed" in fatal["reason"], result.stderr[-2000:]
    assert [(e["step"], e["ranks"], e["cause"]) for e in read_events(run_dir, "replicas_diverged")] == \
        [(5, [1], "no-agreed-snapshot")]


# --- a spike right after a restore (in-process runs) -----------------------------------------


def _spike_run(run_dir: Path, attempt: int) -> Run:
    env = RunEnv(run_id="spike", run_dir=run_dir, precision="fp32", async_save=False, attempt=attempt,
                 restart=attempt > 1, save_every_steps=5, decision_every_steps=1)
    run = Run(env, {}, Policy(resolve("fp32")))
    run.lineage = store.ensure_lineage(run.ckpt_dir, env.run_id).current  # as ckr.init does
    torch.manual_seed(0)
    run.track(model=torch.nn.Linear(2, 1))
    run.restore()
    run._exit_quietly = lambda code: (_ for _ in ()).throw(SystemExit(code))  # type: ignore[method-assign]
    return run


def _feed(run: Run, losses: dict[int, float], steps: int) -> None:
    for _ in run.batches(list(range(steps)), steps=steps):
        run.end_step(losses.get(run.step + 1, 1.0 + 0.01 * ((run.step + 1) % 3)))  # steady, a small spread
    run.finish()


@pytest.mark.parametrize("spike_at, blamed", [(11, True), (13, True), (14, False)])
def test_a_spike_within_k_steps_of_a_restore_blames_it_judged_against_the_window_the_snapshot_carries(
        tmp_path, spike_at, blamed):
    """Snapshot 10 carries the detector's loss window: a 6-sigma spike within K=3 steps after restoring it
    quarantines it as poisoned, exactly as a non-finite loss does; later, it is the training's own (a warning).
    Before: the restored detector had no history, so no spike was seen for min_history steps after a restore."""
    run_dir = tmp_path / "run"
    _feed(_spike_run(run_dir, 1), {}, 10)
    restored = _spike_run(run_dir, 2)
    spiking = {spike_at: 50.0}
    if blamed:
        with pytest.raises(SystemExit) as stopped:
            _feed(restored, spiking, 20)
        assert stopped.value.code == 1, "exit 1: the restart takes the snapshot before it"
    else:
        _feed(restored, spiking, 20)
    quarantined = read_events(run_dir, "snapshot_quarantined")
    if not blamed:
        assert quarantined == [] and [e["step"] for e in read_events(run_dir, "anomaly")] == [spike_at]
        return
    assert [(e["step"], e["cause"]) for e in quarantined] == [(10, "poisoned")]
    assert "std above the mean" in quarantined[0]["reason"] and f"at step {spike_at}" in quarantined[0]["reason"]
    reason = store.quarantine_reason(Path(quarantined[0]["moved_to"]))
    assert reason is not None and reason["status"] == "poisoned" and reason["step"] == spike_at
    assert float(reason["loss"]) == 50.0
    assert store.snapshot_name(10) not in published(run_dir / "checkpoints")


# --- --replica-check-every-steps (two gloo ranks, no torchrun) -----------------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize("every, caught_at", [(2, 4), ("none", 9)])
def test_replica_check_every_n_steps_catches_a_nudged_replica_between_saves(tmp_path, every, caught_at):
    """Rank 1's replica nudged by one ulp at step 3, a save only at the end (step 9): with
    ``--replica-check-every-steps 2`` the ranks compare at step 4, naming rank 1 and the tensor; by default only
    the final save finds it (and publishes nothing). No snapshot agreed before either, so there is nothing to
    restart from: exit 4 on both ranks (issue 38; it was exit 1, and the restart started over from nothing)."""
    port = free_port()
    command = [sys.executable, str(FIXTURES / "replica_check_ranks.py")]
    ranks = [subprocess.Popen([*command, str(rank), str(port), str(tmp_path), str(every), "3", "9"],
                              start_new_session=True, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        codes = [rank.wait(timeout=150) for rank in ranks]
        errors = [rank.stderr.read() if rank.stderr else "" for rank in ranks]
    finally:
        for rank in ranks:
            kill_tree(rank.pid)
    assert codes == [4, 4], errors
    diverged = read_events(tmp_path, "replicas_diverged")
    assert [(e["step"], e["ranks"], e["tensor"], e["policy"], e["cause"]) for e in diverged] == \
        [(caught_at, [1], "model.weight", "restart", "no-agreed-snapshot")], diverged
    assert diverged[0]["at"] == ("check" if every != "none" else "save")
    assert read_events(tmp_path, "snapshot_saved") == [], "no snapshot of diverged replicas is published"
    assert "before any snapshot whose replicas agreed: there is nothing to go back to" in errors[1]
