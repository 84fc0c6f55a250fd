"""Recovery checks without processes: the resume verdict, throughput, the auto cadence, and the supervisor's
budget and resume decisions driven by scripted observations."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from supervisor_helpers import T0, ScriptedWorld, supervisor, training

from ckptrun.cli.errors import CkptrunError
from ckptrun.cli.progress import Status
from ckptrun.cli.recovery_budget import rto_model
from ckptrun.cli.recovery_budget.rto_history import launch_to_first_step
from ckptrun.cli.supervision.observation import Snapshot
from ckptrun.cli.supervision.recovery import RecoveryOptions
from ckptrun.cli.supervision.resume_check import (DIVERGED, EXACT, WITHIN, ResumeWatch, StepLog, flagged,
                                                  resume_verdict, throughput_ratio)
from ckptrun.cli.supervision.spec import build_spec
from ckptrun.runtime.checkpoint import policies
from ckptrun.runtime.checkpoint.policies import AutoCadence

NAN, ULP = float("nan"), math.ulp(2.0)

# --- the verdict --------------------------------------------------------------------


@pytest.mark.parametrize("original, replayed, deterministic, precision, verdict, diff", [
    ({1: 2.0, 2: 1.5}, {1: 2.0, 2: 1.5}, True, "fp32", EXACT, 0.0),
    ({1: 2.0, 2: 1.5}, {1: 2.0 + ULP, 2: 1.5}, True, "fp32", DIVERGED, ULP / 2.0),  # one ulp is not exact
    ({1: 2.0}, {1: 2.0 * (1 + 5e-4)}, False, "fp32", WITHIN, 5e-4),
    ({1: 2.0}, {1: 2.0 * (1 + 2e-3)}, False, "fp32", DIVERGED, 2e-3),
    ({1: 2.0}, {1: 2.0 * (1 + 1e-2)}, False, "bf16", WITHIN, 1e-2),
    ({1: 2.0}, {1: 2.0 * (1 + 3e-2)}, False, "bf16", DIVERGED, 3e-2),
    ({1: 2.0}, {1: 2.0 * (1 + 1e-2)}, False, None, DIVERGED, 1e-2),  # unknown precision: fp32's tolerance
    ({1: NAN}, {1: NAN}, True, "fp32", EXACT, 0.0),
    ({1: 2.0}, {1: NAN}, False, "bf16", DIVERGED, math.inf),
    ({1: 2.0, 2: 1.0}, {2: 1.0, 3: 9.0}, True, "fp32", EXACT, 0.0),  # only steps present in both count
    ({1: 2.0}, {2: 2.0}, True, "fp32", None, None),  # nothing replayed yet
])
def test_resume_verdict_table(original: dict, replayed: dict, deterministic: bool, precision: str | None,
                              verdict: str | None, diff: float | None) -> None:
    result = resume_verdict(original, replayed, deterministic, precision)
    assert result.verdict == verdict
    assert result.max_rel_diff == (pytest.approx(diff, rel=1e-6) if diff not in (None, 0.0, math.inf) else diff)
    assert result.replayed_steps == len(set(original) & set(replayed))


@pytest.mark.parametrize("before, after, ratio", [
    ([t * 0.1 for t in range(21)], [t * 0.1 for t in range(21)], 1.0),
    ([t * 0.1 for t in range(21)], [t * 0.2 for t in range(21)], 0.5),
    ([t * 0.1 for t in range(3)], [t * 0.1 for t in range(21)], None),  # too few steps before
    ([0.0] * 21, [t * 0.1 for t in range(21)], None),  # no time passed
])
def test_throughput_ratio(before: list[float], after: list[float], ratio: float | None) -> None:
    assert throughput_ratio(before, after) == (pytest.approx(ratio) if ratio else None)


def test_throughput_beyond_20_percent_is_flagged() -> None:
    assert [flagged(r) for r in (None, 0.85, 1.19, 0.79, 1.21)] == [False, False, False, True, True]


def test_step_log_keeps_losses_after_the_second_newest_snapshot() -> None:
    log = StepLog()
    for step in range(1, 26):
        log.add({"step": step, "loss": float(step), "time": float(step)})
        if step % 10 == 0:
            log.saved(step)
    assert sorted(log.losses) == list(range(11, 26)) and log.after(20) == {s: float(s) for s in range(21, 26)}
    assert list(log.recent) == [float(t) for t in range(5, 26)]


def test_resume_watch_settles_after_the_replay_and_the_throughput_window() -> None:
    watch = ResumeWatch({11: 1.5, 12: 1.25}, [t * 0.1 for t in range(21)], deterministic=True)
    assert watch.state() == "checking"
    for position, step in enumerate(range(11, 36), start=1):
        watch.add({"step": step, "loss": {11: 1.5, 12: 1.25}.get(step, 1.0), "time": position * 0.1, "precision": "fp32"})
        assert watch.decided() == (step >= 12) and watch.settled() == (position >= 25)
    assert watch.state() == EXACT
    assert watch.fields() == {"resume_verdict": EXACT, "resume_max_rel_diff": 0.0, "replayed_steps": 2,
                              "resume_tolerance": None, "resume_compared": "mean loss",
                              "throughput_ratio": pytest.approx(1.0)}


def test_a_crash_before_its_batch_was_shared_is_checked_on_rank_0s_own_losses() -> None:
    """Issue 26 item 4: the failed attempt's mean lines stop at the last shared batch (step 10), but rank 0 wrote
    its own loss as each step ended (11-13): the resume is judged on those, like with like, and a replayed
    own loss that differs by one ulp is caught. Before: "no replayed step to compare"."""
    log = StepLog()
    for step in range(1, 14):
        log.add({"step": step, "loss": float(step), "own": True})
        if step <= 10:
            log.add({"step": step, "loss": step / 2, "time": float(step)})
    log.saved(10)
    assert log.after(10) == {} and log.own_after(10) == {11: 11.0, 12: 12.0, 13: 13.0}
    watch = ResumeWatch(log.after(10), list(log.recent), True, log.own_after(10))
    for step in (11, 12, 13):
        assert watch.state() == "checking"
        watch.add({"step": step, "loss": float(step), "own": True})
        watch.add({"step": step, "loss": step / 2, "time": float(step)})  # no original mean: ignored
    fields = watch.fields()
    assert (fields["resume_verdict"], fields["replayed_steps"], fields["resume_compared"]) == (EXACT, 3, "rank 0's own loss")
    drifted = ResumeWatch({}, [], True, {11: 11.0, 12: 12.0})
    drifted.add({"step": 11, "loss": math.nextafter(11.0, 12.0), "own": True})
    assert drifted.decided() and drifted.state() == DIVERGED
    resharded = ResumeWatch({11: 5.5}, [], True, {11: 11.0}, resharded=True, precision="fp32")
    resharded.add({"step": 11, "loss": 99.0, "own": True})  # rank 0 ran other batches: its own loss is not judged
    resharded.add({"step": 11, "loss": 5.5, "time": 1.0})
    assert resharded.verdict().verdict == WITHIN and resharded.fields()["resume_compared"] == "mean loss"


def test_resume_watch_diverges_at_the_first_differing_step() -> None:
    watch = ResumeWatch({11: 1.5, 12: 1.25, 13: 1.0}, [], deterministic=True)
    watch.add({"step": 11, "loss": 1.5000001, "time": 1.0})
    assert watch.decided() and watch.verdict().verdict == watch.state() == DIVERGED and not watch.settled()


# --- the auto cadence -----------------------------------------------------------------


def test_runtime_and_cli_share_one_daly() -> None:
    assert rto_model.daly is policies.daly


def test_auto_cadence_saves_first_then_follows_daly_of_the_median_stall() -> None:
    auto = AutoCadence(mtbf=3600.0)
    assert auto.interval == 0.0  # due at the first step boundary
    auto.started()
    assert auto.interval is None  # none due until its cost is known
    first = auto.measured(0.5)
    assert first is not None and first["interval_s"] == rto_model.daly(0.5, 3600.0) == auto.interval
    assert first["stall_s"] == 0.5 and first["mtbf_s"] == 3600.0 and first["reason"].startswith("Daly")
    second = auto.measured(0.1)  # median of 0.5 and 0.1
    assert second is not None and second["stall_s"] == pytest.approx(0.3) and second["interval_s"] == rto_model.daly(0.3, 3600.0)
    assert auto.measured(0.3) is None  # median unchanged: no change, no event
    auto.started()
    assert auto.interval == rto_model.daly(0.3, 3600.0)


def test_auto_cadence_cap_and_a_failed_first_save() -> None:
    auto = AutoCadence(mtbf=3600.0, cap=10.0)
    auto.started()
    auto.failed()
    assert auto.interval == 0.0  # retry at the next step boundary
    change = auto.measured(0.5)
    assert change is not None and change["interval_s"] == 10.0 and change["daly_s"] == rto_model.daly(0.5, 3600.0)
    assert change["reason"].startswith("capped")


def test_max_interval_keeps_the_cost_per_failure_within_the_budget() -> None:
    tau = rto_model.max_interval(budget=120.0, rto=20.0, delta=2.0, w=5.0)
    assert tau == 188.0 and rto_model.cost_per_failure(20.0, tau, 2.0, 5.0) == pytest.approx(120.0)


def test_launch_to_first_step_uses_attempts_that_restored_nothing() -> None:
    events = [{"event": "attempt_start", "attempt": 1, "time": 100.0}, {"event": "attempt_start", "attempt": 2, "time": 200.0},
              {"event": "restored", "attempt": 2, "time": 205.0}]
    metrics = [{"attempt": 1, "step": 1, "time": 112.5}, {"attempt": 2, "step": 11, "time": 209.0}]
    assert launch_to_first_step(events, metrics) == (12.5, 1)


# --- the launch flags ------------------------------------------------------------------


@pytest.mark.parametrize("flags, message", [
    ({"strict_budget": True}, "--strict-budget needs --rto-budget"),
    ({"save_every": "auto", "save_every_steps": 5}, "--save-every auto chooses the interval itself"),
    ({"save_every": "hourly"}, "--save-every hourly: Input should be 'auto'"),
    ({"rto_budget": "0"}, "--rto-budget 0: Input should be greater than 0"),
    ({"mtbf": "often"}, "--mtbf often: 'often' is not a duration"),
])
def test_recovery_flags_are_validated(flags: dict, message: str) -> None:
    with pytest.raises(CkptrunError) as caught:
        build_spec(flags)
    assert caught.value.message.startswith(message) and caught.value.exit_code == 2


def test_recovery_flags_take_durations() -> None:
    spec = build_spec({"rto_budget": "1ms", "strict_budget": True, "save_every": "auto", "mtbf": "3h30m",
                       "time_limit": "3h50m"})
    assert (spec.rto_budget, spec.mtbf, spec.time_limit) == (0.001, 12600.0, 13800.0)
    assert build_spec({}).mtbf == 86400.0


def test_status_line_shows_rto_and_the_resume_verdict() -> None:
    line = Status(attempt=2, restarts=1, step=40, snapshot_step=35, rto_s=15.4, rto_estimate_s=12.0,
                  rto_budget_s=30.0, resume=EXACT).line()
    assert line.endswith("| restarts 1 | RTO 15.4 s (est 12.0 s, budget 30.0 s) | resume exact"), line
    assert "| RTO est 70.0 s (budget 1 ms)" in Status(attempt=1, restarts=0, rto_estimate_s=70.0, rto_budget_s=0.001).line()


# --- the supervisor's decisions, scripted ------------------------------------------------

LOSSES = {step: 3.0 - step / 100 for step in range(1, 41)}
SNAP10 = Snapshot(Path("/ckpt/step-000000010"), 10, verify_s=0.1)
ESTIMATE = {"snapshot_step": 5, "components": {"teardown": {"value_s": 60.0, "source": "assumed", "detail": "grace"}},
            "rto_s": 70.0, "budget_s": 30.0, "ok": False, "largest": "teardown"}


def steps(attempt: int, first: int, last: int, start: float, losses: dict[int, float] = LOSSES) -> list[dict[str, Any]]:
    return [{"step": s, "attempt": attempt, "loss": losses[s], "time": start + (s - first) * 0.1, "precision": "fp32"}
            for s in range(first, last + 1)]


def crashed_then_resumed(resumed_losses: dict[int, float]) -> ScriptedWorld:
    """Attempt 1 trains 1..12 (snapshots 5, 10; an estimate arrives) and crashes; attempt 2 replays from 10."""
    attempt1 = [training(T0 + 4, 5, steps=steps(1, 1, 5, T0 + 3), snapshot_step=5),
                training(T0 + 5, 10, steps=steps(1, 6, 10, T0 + 3.5), snapshot_step=10, rto_estimate=ESTIMATE),
                training(T0 + 6, 12, steps=steps(1, 11, 12, T0 + 4), snapshot_step=10, agent_exit=1)]
    attempt2 = [training(T0 + 20, 40, steps=steps(2, 11, 40, T0 + 19, resumed_losses), first_step=T0 + 19),
                training(T0 + 21, 40, first_step=T0 + 19, agent_exit=0)]
    return ScriptedWorld({1: attempt1, 2: attempt2}, events_by_attempt={1: {"snapshot_saved": [{"step": 10}]}},
                         snapshots=[SNAP10])


def test_restart_event_records_rto_measured_estimated_budget_and_an_exact_resume() -> None:
    world = crashed_then_resumed(LOSSES)
    outcome = supervisor(world, recovery=RecoveryOptions(rto_budget_s=30.0)).supervise()
    # once, at attempt 1's first snapshot; the next restart is the first: no back-off
    assert outcome.code == 0 and world.estimates_requested == [(1, 0.0)]
    [logged] = world.events("rto_estimate")
    assert logged["attempt"] == 1 and logged["rto_s"] == 70.0
    assert sum("warning: RTO estimate 70.0 s" in line for line in world.said) == 1, world.said
    [restart] = world.events("restart")
    assert restart["rto_measured_s"] == restart["rto_s"] is not None
    assert (restart["rto_estimated_s"], restart["rto_budget_s"]) == (70.0, 30.0)
    assert (restart["resume_verdict"], restart["replayed_steps"], restart["resume_max_rel_diff"]) == (EXACT, 2, 0.0)
    assert restart["throughput_ratio"] == pytest.approx(1.0) and not restart["throughput_flagged"]
    assert any(shown.get("resume") == EXACT and shown.get("rto_s") for shown in world.shown)


def test_strict_budget_asks_the_workers_to_stop_and_exits_1() -> None:
    world = crashed_then_resumed(LOSSES)
    world.script[1][2] = training(T0 + 6, 12, agent_exit=3)
    world.events_by_attempt[1]["stopped"] = [{"step": 12}]
    outcome = supervisor(world, recovery=RecoveryOptions(rto_budget_s=30.0, strict_budget=True)).supervise()
    assert outcome.code == 1 and world.stop_requests == 1 and len(world.launches) == 1
    assert outcome.message.startswith("RTO estimate 70.0 s") and "largest part: teardown" in outcome.message
    assert "resume --latest" in (outcome.hint or "")
    assert world.events("gave_up")[0]["exit_code"] == 1


@pytest.mark.parametrize("require_exact, code", [(False, 0), (True, 4)])
def test_diverged_resume_is_flagged_and_with_require_exact_ends_the_run(require_exact: bool, code: int) -> None:
    world = crashed_then_resumed({**LOSSES, 12: LOSSES[12] + 1e-9})
    outcome = supervisor(world, recovery=RecoveryOptions(require_exact_resume=require_exact)).supervise()
    assert outcome.code == code and len(world.launches) == 2
    [restart] = world.events("restart")
    assert restart["resume_verdict"] == DIVERGED and restart["resume_max_rel_diff"] > 0
    assert any("WARNING: resume check: diverged" in line for line in world.said)
    if require_exact:
        assert world.teardowns == 2 and "diverged" in outcome.message and world.events("gave_up")[0]["exit_code"] == 4


def test_a_resume_at_another_global_batch_is_not_compared() -> None:
    """A node came or went and the global batch changed: the replayed losses are of other batches, never 'diverged'."""
    from ckptrun.cli.supervision.recovery import Recovery

    recovery = Recovery(RecoveryOptions(deterministic=True, require_exact_resume=True))
    recovery.note([{"step": s, "loss": 2.0 - s / 10, "time": T0 + s} for s in range(1, 13)], snapshot_step=10)
    recovery.restarting(10)
    recovery.resharded()
    recovery.batch_changed()
    recovery.note([{"step": s, "loss": 9.0, "time": T0 + 20 + s} for s in (11, 12)], snapshot_step=None)
    assert not recovery.diverged()
    fields = recovery.restart_fields(1.0)
    assert fields["resume_verdict"] is None and fields["replayed_steps"] == 0, fields


def test_a_restart_followed_by_too_few_steps_is_not_judged_on_throughput() -> None:
    """Issue 28 item 5: a small run's few steps after a restart (warm-up among them) are no throughput verdict."""
    before = [t * 0.1 for t in range(21)]
    short = ResumeWatch({}, before, deterministic=True)
    for position in range(1, 20):  # 19 steps after the restart, the second half ten times slower
        short.add({"step": position, "time": position * (0.1 if position < 10 else 1.0)})
    assert short.throughput() is None and not flagged(short.throughput())
    whole = ResumeWatch({}, before, deterministic=True)
    for position in range(1, 26):
        whole.add({"step": position, "time": position * 0.2})
    assert whole.throughput() == pytest.approx(0.5) and flagged(whole.throughput())
