"""The supervisor's state machine and policies, driven by scripted observations: no processes, no sleeps."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from supervisor_helpers import (STACK_IN_SCRIPT, STACK_IN_TORCH, T0, TIMEOUTS, ScriptedWorld, beat, supervisor,
                                training)

from ckptrun.cli.supervision.failures import RankFailure, describe_failure, root_cause
from ckptrun.cli.supervision.observation import Observation, RankView, Snapshot, StopControl
from ckptrun.cli.supervision.policy import GiveUp, Restart, RestartFacts, RestartPolicy, pick_suspect, stale_ranks, waiting_on_peers
from ckptrun.cli.supervision.recovery import STARTUP_PARTS, relaunch_parts

SNAP15 = Snapshot(Path("/ckpt/step-000000015"), 15, verify_s=0.1)


def test_success_first_attempt() -> None:
    world = ScriptedWorld({1: [training(T0 + 3, 1), training(T0 + 4, 30, agent_exit=0)]})
    outcome = supervisor(world).supervise()
    assert outcome.code == 0 and outcome.restarts == 0
    assert world.launches == [(1, None)] and world.teardowns == 1 and world.failed_teardowns == 0


def test_crash_restarts_from_verified_snapshot_and_logs_rto() -> None:
    gone = training(T0 + 5, 17)
    gone.ranks[1] = RankView(False, beat(1, 17, T0 + 4.9))
    world = ScriptedWorld(
        {1: [training(T0 + 4, 16), gone, replace(gone, time=T0 + 5.5, agent_exit=1)],
         2: [training(T0 + 12, 15, first_step=None), training(T0 + 13, 16, first_step=T0 + 12.8),
             training(T0 + 14, 30, agent_exit=0)]},
        failures_by_attempt={1: [RankFailure(rank=0, exit_code=-15, signal="SIGTERM", time=T0 + 5),
                                 RankFailure(rank=1, exit_code=-9, signal="SIGKILL", time=T0 + 5)]},
        events_by_attempt={1: {"snapshot_saved": [{"step": 15}]},
                           2: {"restored": [{"time": T0 + 12.5, "seconds": 0.3}]}},
        snapshots=[SNAP15],
    )
    outcome = supervisor(world).supervise()
    assert outcome.code == 0 and outcome.restarts == 1
    assert world.launches == [(1, None), (2, SNAP15.path)]
    [failure] = world.events("failure")
    assert failure["cause"] == "crash" and failure["rank"] == 1 and failure["signal"] == "SIGKILL"
    assert failure["detected_at"] == T0 + 5 and failure["step"] == 17
    [restart] = world.events("restart")
    assert restart["snapshot_step"] == 15 and restart["lost_steps"] == 2 and restart["verify_s"] == 0.1
    assert restart["backoff_s"] == 0.0 and restart["detect_s"] == pytest.approx(0.1)
    assert world.teardowns == 2 and world.failed_teardowns == 1  # the crashed attempt's: the short SIGKILL grace
    assert restart["relaunch_to_first_step_s"] == pytest.approx(T0 + 12.8 - restart_launch_time(world))
    assert restart["restore_s"] == 0.3 and restart["rto_s"] is not None


def restart_launch_time(world: ScriptedWorld) -> float:
    # attempt 2 was launched right after teardown (T0+5.5): no back-off before the first restart
    return T0 + 5.5


def test_hang_dumps_stacks_names_suspect_then_restarts() -> None:
    stalled = Observation(time=T0 + 20, ranks={0: RankView(True, beat(0, 12, T0 + 10)), 1: RankView(True, beat(1, 12, T0 + 10.2))},
                          first_step_time=T0 + 3, last_step=12, last_step_time=T0 + 10)
    world = ScriptedWorld({1: [training(T0 + 9, 11), stalled], 2: [training(T0 + 30, 30, agent_exit=0)]},
                          events_by_attempt={1: {"snapshot_saved": [{"step": 10}]}},
                          snapshots=[Snapshot(Path("/ckpt/step-000000010"), 10)])
    outcome = supervisor(world).supervise()
    assert outcome.code == 0 and world.dumped == [[0, 1]]
    [failure] = world.events("failure")
    assert failure["cause"] == "hang" and failure["stale_ranks"] == [0, 1] and failure["suspect"] == 0
    assert failure["waiting_on_peers"] == {"0": False, "1": True}
    assert world.failed_teardowns == 1



def test_a_hang_blames_the_rank_outside_torch_even_when_a_waiting_peer_times_out_first() -> None:
    """Rank 0 hangs in its own code right after rank 1's last beat; rank 1, blocked in the next all-reduce,
    crosses the timeout first: rank 0 is still the suspect, and the line says why."""
    stalled = Observation(time=T0 + 15.1, ranks={0: RankView(True, beat(0, 12, T0 + 10.2)), 1: RankView(True, beat(1, 12, T0 + 10.0))},
                          first_step_time=T0 + 3, last_step=12, last_step_time=T0 + 10)
    world = ScriptedWorld({1: [training(T0 + 9, 11), stalled], 2: [training(T0 + 30, 30, agent_exit=0)]},
                          events_by_attempt={1: {"snapshot_saved": [{"step": 10}]}},
                          snapshots=[Snapshot(Path("/ckpt/step-000000010"), 10)])
    assert supervisor(world).supervise().code == 0 and world.dumped == [[0, 1]]
    [failure] = world.events("failure")
    assert (failure["stale_ranks"], failure["suspect"], failure["waiting_on_peers"]) == ([1], 0, {"0": False, "1": True})
    assert describe_failure(failure) == ("ranks [1] stopped making progress (suspect: rank 0, not waiting on its peers; "
                                         "phase train, step 12)")

def test_save_phase_gets_its_own_allowance() -> None:
    saving = Observation(time=T0 + 60, ranks={0: RankView(True, beat(0, 10, T0 + 5, "save"))})
    assert stale_ranks(saving, {0: saving.ranks[0].beat}, T0, TIMEOUTS, runtime_seen=True) == []
    training_silent = Observation(time=T0 + 60, ranks={0: RankView(True, beat(0, 10, T0 + 5, "train"))})
    assert stale_ranks(training_silent, {0: training_silent.ranks[0].beat}, T0, TIMEOUTS, True) == [0]


def test_script_without_any_heartbeat_is_never_called_hung_nor_called_plain() -> None:
    silent = [Observation(time=T0 + t, ranks={0: RankView(True), 1: RankView(True)}) for t in (1, 61, 62, 63)]
    silent.append(Observation(time=T0 + 64, ranks={0: RankView(True), 1: RankView(True)}, agent_exit=0))
    world = ScriptedWorld({1: silent})
    assert supervisor(world).supervise().code == 0
    assert not any("does not use ckptrun.runtime" in line for line in world.said)  # not known: not said


def plain(time: float, step: int, beat_time: float, **kw: object) -> Observation:
    """Two ranks of a plain script, seen through the bootstrap's optimizer-step hook."""
    ranks = {r: RankView(True, beat(r, step, beat_time, source="step-hook")) for r in range(2)}
    return Observation(time=time, ranks=ranks, first_step_time=T0 + 3, last_step=step, last_step_time=beat_time, **kw)


def test_plain_script_is_told_once_watched_for_hangs_and_resumes_from_its_own_files() -> None:
    hung = [plain(T0 + 4, 3, T0 + 4), plain(T0 + 8, 5, T0 + 8), plain(T0 + 14, 5, T0 + 8)]
    world = ScriptedWorld({1: hung, 2: [plain(T0 + 30, 20, T0 + 30, agent_exit=0)]})
    assert supervisor(world, faults="kill:rank=1:step=5;kill-during-save:rank=0").supervise().code == 0 and world.dumped == [[0, 1]]
    assert sum("does not use ckptrun.runtime" in line for line in world.said) == 1
    assert sum("kill-during-save can never fire" in line for line in world.said) == 1
    [failure] = world.events("failure")
    assert failure["cause"] == "hang" and failure["plain_script"] is True
    assert any("attempt 2 (the script is relaunched: its step count will say whether it resumed)" in line for line in world.said)
    assert len(world.events("plain_script")) == 1


@pytest.mark.parametrize("phases, relaunched", [(("returned", "returned"), False), (("returned", "train"), True)])
def test_a_plain_script_that_dies_in_teardown_after_returning_on_every_rank_is_completed(phases, relaunched) -> None:
    """#23 follow-up: gloo can abort a rank at interpreter exit, after the script returned (exit -6). When every
    rank beat ``returned`` the run completed (not relaunched, exit 0, said); a rank still training is a crash.
    Before: counted as a crash and the finished script ran again."""
    ranks = {r: RankView(False, beat(r, 20, T0 + 9, phase=phase, source="step-hook")) for r, phase in enumerate(phases)}
    ended = Observation(time=T0 + 10, ranks=ranks, first_step_time=T0 + 3, last_step=20, last_step_time=T0 + 9, agent_exit=-6)
    world = ScriptedWorld({1: [plain(T0 + 4, 3, T0 + 4), ended], 2: [plain(T0 + 30, 20, T0 + 30, agent_exit=0)]})
    outcome = supervisor(world).supervise()
    assert outcome.code == 0 and (len(world.launches) == 2) == relaunched
    assert bool(world.events("died_after_return")) != relaunched
    assert any("counted as completed, not relaunched" in line for line in world.said) != relaunched


@pytest.mark.parametrize("agent_exit, code", [(0, 3), (1, 1)])
def test_stopping_a_plain_script_sends_sigterm_and_exits_3_only_when_it_exits_cleanly(agent_exit: int, code: int) -> None:
    world = ScriptedWorld({1: [plain(T0 + 4, 3, T0 + 4), plain(T0 + 5, 4, T0 + 5), plain(T0 + 6, 4, T0 + 5, agent_exit=agent_exit)]},
                          stop_signal_after=(1, 1))
    outcome = supervisor(world).supervise()
    assert outcome.code == code and world.terminated == 1
    assert any("cannot be asked to save" in line for line in world.said)
    assert ("exited cleanly" in outcome.message) == (code == 3)


def test_give_up_shows_the_failing_ranks_last_stderr_lines_and_its_log() -> None:
    world = ScriptedWorld({1: [Observation(time=T0 + 2, agent_exit=1)]},
                          failures_by_attempt={1: [RankFailure(rank=0, exit_code=2, exception="exited with code 2", uses_runtime=False,
                                                               log="runs/x/logs/attempt-1/rank-0/stderr.log",
                                                               stderr_tail=["usage: t.py [-h]", "t.py: error: unrecognized arguments: --stpes"])]})
    outcome = supervisor(world).supervise()
    assert outcome.code == 4 and len(world.launches) == 1
    assert any("unrecognized arguments: --stpes" in line for line in world.said)
    assert "runs/x/logs/attempt-1/rank-0/stderr.log" in (outcome.hint or "")
    assert sum("does not use ckptrun.runtime" in line for line in world.said) == 1


def test_runtime_script_silent_at_startup_after_runtime_was_seen_is_a_hang() -> None:
    assert stale_ranks(Observation(time=T0 + 61, ranks={0: RankView(True)}), {}, T0, TIMEOUTS, runtime_seen=True) == [0]
    assert stale_ranks(Observation(time=T0 + 59, ranks={0: RankView(True)}), {}, T0, TIMEOUTS, runtime_seen=True) == []


def test_failure_before_first_step_of_first_attempt_exits_4() -> None:
    starting = Observation(time=T0 + 2, ranks={0: RankView(True, beat(0, 0, T0 + 2, "init"))})
    world = ScriptedWorld({1: [starting, Observation(time=T0 + 3, agent_exit=1)]},
                          failures_by_attempt={1: [RankFailure(rank=0, exit_code=1, exception="ValueError: bad", time=T0 + 3)]})
    outcome = supervisor(world).supervise()
    assert outcome.code == 4 and len(world.launches) == 1
    assert "before its first step" in outcome.message and "ValueError: bad" in outcome.message


def test_script_that_fails_to_load_exits_4_without_heartbeats() -> None:
    world = ScriptedWorld({1: [Observation(time=T0 + 2, agent_exit=1)]},
                          failures_by_attempt={1: [RankFailure(rank=0, exit_code=1, exception="SyntaxError: x", phase="load")]})
    assert supervisor(world).supervise().code == 4 and len(world.launches) == 1


def test_fatal_record_is_not_retried_and_keeps_its_exit_code() -> None:
    world = ScriptedWorld({1: [training(T0 + 4, 5), training(T0 + 5, 5, agent_exit=1)]},
                          fatal={1: [{"rank": 0, "reason": "unsupported precision", "exit_code": 2}]})
    outcome = supervisor(world).supervise()
    assert outcome.code == 2 and len(world.launches) == 1


def test_restart_budget_exhausted_exits_1() -> None:
    crash = lambda t, step: [training(t, step), training(t + 1, step, agent_exit=1)]  # noqa: E731
    world = ScriptedWorld({1: crash(T0 + 4, 7), 2: crash(T0 + 20, 12)},
                          events_by_attempt={1: {"snapshot_saved": [{}]}, 2: {"snapshot_saved": [{}]}},
                          snapshots=[Snapshot(Path("/c/step-000000005"), 5), Snapshot(Path("/c/step-000000010"), 10)])
    outcome = supervisor(world, max_restarts=1).supervise()
    assert outcome.code == 1 and outcome.restarts == 1 and len(world.launches) == 2
    assert world.events("gave_up")[0]["exit_code"] == 1


def test_restarts_without_new_snapshots_exit_4() -> None:
    crash = lambda t: [training(t, 17), training(t + 1, 17, agent_exit=1)]  # noqa: E731
    world = ScriptedWorld({1: crash(T0 + 4), 2: crash(T0 + 20), 3: crash(T0 + 40), 4: crash(T0 + 60)},
                          events_by_attempt={1: {"snapshot_saved": [{}]}}, snapshots=[SNAP15] * 4)
    outcome = supervisor(world, max_restarts=5).supervise()
    assert outcome.code == 4 and "no new snapshot" in outcome.message and len(world.launches) == 3


def test_signal_asks_workers_to_stop_and_exits_3() -> None:
    world = ScriptedWorld({1: [training(T0 + 4, 8), training(T0 + 5, 9), training(T0 + 6, 9, agent_exit=1)]},
                          events_by_attempt={1: {"stopped": [{"step": 9}]}}, snapshots=[Snapshot(Path("/c/s9"), 9)],
                          stop_signal_after=(1, 0))
    outcome = supervisor(world).supervise()
    assert outcome.code == 3 and world.stop_requests == 1 and len(world.launches) == 1
    assert world.events("stop_requested")[0]["reason"].startswith("signal")


def test_second_signal_kills_and_still_exits_3_with_a_snapshot() -> None:
    stop = StopControl()
    world = ScriptedWorld({1: [training(T0 + 4, 8), training(T0 + 5, 8), training(T0 + 6, 8)]},
                          snapshots=[Snapshot(Path("/c/s5"), 5)], stop_signal_after=(1, 0))
    sup = supervisor(world, stop=stop)
    world.stop_signal_after = None
    stop.signals = 2
    outcome = sup.supervise()
    assert outcome.code == 3 and world.events("stop_forced") and world.teardowns == 1


def test_grace_period_running_out_kills_exit_1_without_snapshot() -> None:
    stuck = [training(T0 + 4, 8)] + [training(T0 + 4 + 10 * i, 8) for i in range(1, 6)]
    world = ScriptedWorld({1: stuck}, stop_signal_after=(1, 0))
    outcome = supervisor(world).supervise()
    assert outcome.code == 1 and world.events("stop_forced")


def test_time_limit_requests_a_stop() -> None:
    world = ScriptedWorld({1: [training(T0 + 4, 8), training(T0 + 10, 12), training(T0 + 11, 12, agent_exit=1)]},
                          events_by_attempt={1: {"stopped": [{"step": 12}]}}, snapshots=[Snapshot(Path("/c/s12"), 12)])
    outcome = supervisor(world, stop=StopControl(stop_at=T0 + 9)).supervise()
    assert outcome.code == 3 and world.events("stop_requested")[0]["reason"] == "time limit"


def test_injected_exit_code_3_without_a_stop_request_is_a_crash() -> None:
    world = ScriptedWorld({1: [training(T0 + 4, 13), training(T0 + 5, 13, agent_exit=1)], 2: [training(T0 + 9, 30, agent_exit=0)]},
                          failures_by_attempt={1: [RankFailure(rank=1, exit_code=3, time=T0 + 5)]},
                          events_by_attempt={1: {"snapshot_saved": [{}]}}, snapshots=[Snapshot(Path("/c/s10"), 10)])
    assert supervisor(world).supervise().code == 0 and len(world.launches) == 2


@pytest.mark.parametrize("restarts, delay", [(0, 0.0), (1, 1.0), (2, 2.0), (3, 4.0), (6, 4.0)])
def test_no_backoff_before_the_first_restart_then_doubling_and_capped(restarts: int, delay: float) -> None:
    facts = RestartFacts(False, True, False, restarts=restarts, stalled_restarts=0)
    assert RestartPolicy(max_restarts=10, backoff=1.0, backoff_cap=4.0).verdict(facts) == Restart(delay)


@pytest.mark.parametrize("facts, code", [
    (RestartFacts(True, False, False, 0, 0), 4),  # any script, runtime or plain: a restart fails the same way
    (RestartFacts(False, False, False, 0, 0), None),  # a later attempt (or resume) that failed early: restart
    (RestartFacts(False, True, True, 0, 0), 4),
    (RestartFacts(False, True, False, 3, 0), 1),
    (RestartFacts(False, True, False, 1, 2), 4),
    (RestartFacts(False, True, False, 0, 0, fatal=[{"exit_code": 7, "reason": "x"}]), 4),
])
def test_policy_table(facts: RestartFacts, code: int | None) -> None:
    verdict = RestartPolicy(max_restarts=3, max_stalled_restarts=2).verdict(facts)
    assert (verdict.code if isinstance(verdict, GiveUp) else None) == code


def test_root_cause_prefers_the_earliest_non_teardown_failure() -> None:
    teardown = RankFailure(rank=0, exit_code=-15, signal="SIGTERM", time=10.0)
    killed = RankFailure(rank=1, exit_code=-9, signal="SIGKILL", time=10.0)
    assert root_cause([teardown, killed]) is killed
    both = [RankFailure(rank=1, exit_code=1, exception="E", time=5.0), RankFailure(rank=0, exit_code=1, exception="E", time=5.0)]
    assert root_cause(both).rank == 0


def test_suspect_is_the_rank_not_waiting_in_torch() -> None:
    beats = {0: beat(0, 12, T0), 1: beat(1, 12, T0 - 1)}
    assert waiting_on_peers(STACK_IN_SCRIPT) is False and waiting_on_peers(STACK_IN_TORCH) is True
    assert pick_suspect([0, 1], beats, {0: STACK_IN_SCRIPT, 1: STACK_IN_TORCH}) == 0
    assert pick_suspect([0, 1], beats, {}) == 1  # no stacks: the one silent longest at the same step


def test_relaunch_startup_is_split_at_the_workers_milestones() -> None:
    marks = {"process": 101.0, "bootstrap": 101.5, "torch_imported": 103.0, "init": 104.0, "process_group": 105.0}
    parts = relaunch_parts(100.0, 110.0, [{"time": 109.0, "seconds": 1.0, "startup": marks}])
    assert parts == pytest.approx({"relaunch_to_first_step_s": 10.0, "startup_s": 8.0, "restore_s": 1.0, "first_step_s": 1.0,
                                   "spawn_s": 1.0, "interpreter_s": 0.5, "import_torch_s": 1.5, "script_imports_s": 1.0,
                                   "process_group_s": 1.0, "until_restore_s": 3.0})
    parts = relaunch_parts(100.0, 110.0, [{"time": 109.0, "seconds": 1.0, "startup": {**marks, "torch_imported": None}}])
    assert "import_torch_s" not in parts and parts["script_imports_s"] == pytest.approx(2.5)  # folded into the next part
    assert sum(parts[p] for _, p in STARTUP_PARTS if p in parts) == pytest.approx(parts["startup_s"])
