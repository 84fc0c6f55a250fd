"""The supervisor's state machine and policies, driven by scripted observations: no processes, no sleeps."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from ckptrun.cli.failures import RankFailure, root_cause
from ckptrun.cli.policy import (GiveUp, Restart, RestartFacts, RestartPolicy, Timeouts, pick_suspect, stale_ranks,
                                waiting_on_peers)
from ckptrun.cli.supervisor import Observation, RankView, Snapshot, StopControl, Supervisor
from ckptrun.runtime.records import Heartbeat

T0 = 1000.0


def beat(rank: int, step: int, time: float, phase: str = "train", attempt: int = 1) -> Heartbeat:
    return Heartbeat(rank=rank, pid=100 + rank, attempt=attempt, step=step, phase=phase, time=time)


def training(time: float, step: int, ranks: int = 2, first_step: float | None = T0 + 3, **kw: Any) -> Observation:
    views = {r: RankView(True, beat(r, step, time - 0.5)) for r in range(ranks)}
    return Observation(time=time, ranks=views, first_step_time=first_step, last_step=step, last_step_time=time - 0.5, **kw)


@dataclass
class ScriptedWorld:
    """A world whose observations, failures and snapshots are scripted per attempt."""

    script: dict[int, list[Observation]]
    failures_by_attempt: dict[int, list[RankFailure]] = field(default_factory=dict)
    events_by_attempt: dict[int, dict[str, list[dict[str, Any]]]] = field(default_factory=dict)
    snapshots: list[Snapshot | None] = field(default_factory=list)
    fatal: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    stop_signal_after: tuple[int, int] | None = None  # (attempt, poll index): a signal arrives then
    stop: StopControl | None = None
    clock: float = T0
    attempt: int = 0
    poll: int = 0
    launches: list[tuple[int, Path | None]] = field(default_factory=list)
    logged: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    said: list[str] = field(default_factory=list)
    teardowns: int = 0
    dumped: list[list[int]] = field(default_factory=list)
    stop_requests: int = 0

    def now(self) -> float:
        return self.clock

    def sleep(self, seconds: float) -> None:
        self.clock += seconds

    def launch(self, attempt: int, resume_from: Path | None) -> None:
        self.attempt, self.poll = attempt, 0
        self.launches.append((attempt, resume_from))

    def observe(self) -> Observation:
        observations = self.script[self.attempt]
        obs = observations[min(self.poll, len(observations) - 1)]
        if self.stop_signal_after == (self.attempt, self.poll) and self.stop:
            self.stop.signals += 1
        self.poll += 1
        self.clock = max(self.clock, obs.time)
        return obs

    def failures(self) -> tuple[list[RankFailure], str | None]:
        return self.failures_by_attempt.get(self.attempt, []), None

    def fatal_records(self) -> list[dict[str, Any]]:
        return self.fatal.get(self.attempt, [])

    def attempt_events(self, name: str) -> list[dict[str, Any]]:
        return self.events_by_attempt.get(self.attempt, {}).get(name, [])

    def dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        self.dumped.append(ranks)
        return {r: STACK_IN_SCRIPT if r == 0 else STACK_IN_TORCH for r in ranks}

    def teardown(self) -> float:
        self.teardowns += 1
        return 0.5

    def newest_snapshot(self) -> Snapshot | None:
        return self.snapshots.pop(0) if self.snapshots else None

    def request_stop(self) -> None:
        self.stop_requests += 1

    def stop_file_present(self) -> bool:
        return False

    def event(self, name: str, **fields: Any) -> None:
        self.logged.append((name, fields))

    def say(self, line: str) -> None:
        self.said.append(line)

    def show_progress(self, attempt: int, restarts: int, observation: Observation) -> None:
        pass

    def events(self, name: str) -> list[dict[str, Any]]:
        return [fields for event, fields in self.logged if event == name]


STACK_IN_SCRIPT = """Thread 0x1 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 327 in wait

Current thread 0x2 (most recent call first):
  File "/w/runtime/session.py", line 98 in _fire
  File "/w/train.py", line 77 in <module>
  File "<frozen runpy>", line 198 in _run_module_as_main
"""
STACK_IN_TORCH = """Current thread 0x2 (most recent call first):
  File "/v/site-packages/torch/autograd/graph.py", line 979 in _engine_run_backward
  File "/w/train.py", line 77 in <module>
"""

TIMEOUTS = Timeouts(heartbeat=5.0, startup=60.0, save=120.0, grace=30.0, poll=0.2)


def supervisor(world: ScriptedWorld, max_restarts: int = 3, stop: StopControl | None = None, **kw: Any) -> Supervisor:
    stop = stop or StopControl()
    world.stop = stop
    return Supervisor(world, RestartPolicy(max_restarts, backoff=1.0, backoff_cap=4.0), TIMEOUTS, stop, **kw)


SNAP15 = Snapshot(Path("/ckpt/step-000000015"), 15, verify_s=0.1)


def test_success_first_attempt() -> None:
    world = ScriptedWorld({1: [training(T0 + 3, 1), training(T0 + 4, 30, agent_exit=0)]})
    outcome = supervisor(world).supervise()
    assert outcome.code == 0 and outcome.restarts == 0
    assert world.launches == [(1, None)] and world.teardowns == 1


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
    assert restart["backoff_s"] == 1.0 and restart["detect_s"] == pytest.approx(0.1)
    assert restart["relaunch_to_first_step_s"] == pytest.approx(T0 + 12.8 - restart_launch_time(world))
    assert restart["restore_s"] == 0.3 and restart["rto_s"] is not None


def restart_launch_time(world: ScriptedWorld) -> float:
    # attempt 2 was launched right after teardown (T0+5.5) and the 1 s back-off
    return T0 + 5.5 + 1.0


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


def test_save_phase_gets_its_own_allowance() -> None:
    saving = Observation(time=T0 + 60, ranks={0: RankView(True, beat(0, 10, T0 + 5, "save"))})
    assert stale_ranks(saving, {0: saving.ranks[0].beat}, T0, TIMEOUTS, runtime_seen=True) == []
    training_silent = Observation(time=T0 + 60, ranks={0: RankView(True, beat(0, 10, T0 + 5, "train"))})
    assert stale_ranks(training_silent, {0: training_silent.ranks[0].beat}, T0, TIMEOUTS, True) == [0]


def test_plain_script_is_never_called_hung_but_told_once() -> None:
    silent = [Observation(time=T0 + t, ranks={0: RankView(True), 1: RankView(True)}) for t in (1, 61, 62, 63)]
    silent.append(Observation(time=T0 + 64, ranks={0: RankView(True), 1: RankView(True)}, agent_exit=0))
    world = ScriptedWorld({1: silent})
    assert supervisor(world).supervise().code == 0
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


@pytest.mark.parametrize("restarts, delay", [(0, 1.0), (1, 2.0), (2, 4.0), (5, 4.0)])
def test_backoff_doubles_and_is_capped(restarts: int, delay: float) -> None:
    facts = RestartFacts(False, True, True, False, restarts=restarts, stalled_restarts=0)
    assert RestartPolicy(max_restarts=10, backoff=1.0, backoff_cap=4.0).verdict(facts) == Restart(delay)


@pytest.mark.parametrize("facts, code", [
    (RestartFacts(True, False, True, False, 0, 0), 4),
    (RestartFacts(True, False, False, False, 0, 0), None),  # plain script: progress unknown, restart
    (RestartFacts(False, True, True, True, 0, 0), 4),
    (RestartFacts(False, True, True, False, 3, 0), 1),
    (RestartFacts(False, True, True, False, 1, 2), 4),
    (RestartFacts(False, True, True, False, 0, 0, fatal=[{"exit_code": 7, "reason": "x"}]), 4),
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
