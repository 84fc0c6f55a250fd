"""The one supervise() loop on the many-node decision path: attempts scripted (no ranks), the job's store real.

The same loop as one node's (tests/test_supervisor_unit.py), with a NodeJob in place of OneNode: the
leader gathers the nodes before its verdict and publishes the next attempt and the job's verdict through
the store; a follower runs the attempt the leader publishes and ends with the leader's verdict.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from launch_helpers import wait_for
from supervisor_helpers import T0, ScriptedNodeWorld, node_supervisor, training

from ckptrun.cli.supervision.job_store import JobStore
from ckptrun.cli.supervision.failures import RankFailure
from ckptrun.cli.supervision.node_world import post_failure
from ckptrun.cli.supervision.observation import Observation, Outcome, RankView, Snapshot

SNAP15 = Snapshot(Path("/ckpt/step-000000015"), 15, verify_s=0.1)
pytestmark = pytest.mark.timeout(120)


def crashed(time: float, step: int) -> Observation:
    """Rank 1's process is gone and this node's torchrun exited 1."""
    obs = training(time, step, agent_exit=1)
    obs.ranks[1] = RankView(False, obs.ranks[1].beat)
    return obs


def stores(name: str) -> tuple[JobStore, JobStore]:
    leader = JobStore.host(name, "127.0.0.1", 0)
    return leader, JobStore.connect(name, "127.0.0.1", leader.port, timeout_s=5)


def test_the_leader_restarts_every_node_through_the_store_and_publishes_the_verdict() -> None:
    leader, follower = stores("run-lead")
    follower.join(1)
    follower.ack_teardown(1, 1)  # node 1 tore attempt 1 down, and it will have read the verdict
    follower.ack_teardown("end", 1, code=0)
    world = ScriptedNodeWorld({1: [training(T0 + 4, 16), crashed(T0 + 5, 17)],
                               2: [training(T0 + 12, 15, first_step=None), training(T0 + 14, 30, agent_exit=0)]},
                              events_by_attempt={1: {"snapshot_saved": [{"step": 15}]}}, snapshots=[SNAP15], job=leader)
    outcome = node_supervisor(world).supervise()
    assert outcome.code == 0 and outcome.restarts == 1, outcome
    assert world.launches == [(1, None), (2, SNAP15.path)]
    published = leader.attempt()
    assert published is not None and published["attempt"] == 2 and published["nodes"] == [0, 1]
    assert published["snapshot"]["path"] == str(SNAP15.path) and published["snapshot"]["step"] == 15
    verdict = leader.verdict()
    assert verdict is not None and (verdict["action"], verdict["code"], verdict["restarts"]) == ("done", 0, 1)
    [restart] = world.events("restart")
    assert restart["nodes"] == [0, 1] and restart["lost_nodes"] == [] and restart["node_join_s"] >= 0


def test_the_leader_gives_up_when_a_lost_node_does_not_rejoin() -> None:
    leader, follower = stores("run-lost")
    follower.join(1)
    follower.ack_teardown(1, 1)
    follower.ack_teardown("end", 1, code=1)
    follower.report_failure(1, node=1, ranks=[], cause="node lost", detail="node 1's supervisor stopped beating")
    world = ScriptedNodeWorld({1: [training(T0 + 4, 16), crashed(T0 + 5, 17)]}, job=leader)
    outcome = node_supervisor(world, join_timeout=0.5).supervise()
    assert outcome.code == 1 and "node 1 was lost and no launcher of node rank 1 joined" in outcome.message
    assert world.launches == [(1, None)] and world.events("node_wait") == [{"node": 1, "join_timeout_s": 0.5}]
    [gave_up] = world.events("gave_up")
    assert gave_up["exit_code"] == 1
    verdict = leader.verdict()
    assert verdict is not None and (verdict["action"], verdict["code"]) == ("gave_up", 1)


def test_every_line_names_the_root_cause_the_job_agreed_on_not_the_leaders_collateral_error() -> None:
    """Node 1's rank 3 was SIGKILLed; the leader's rank 0 saw only gloo's connection error: the printed
    line, the event and the final message name node 1's rank and the signal first, the collateral after."""
    leader, follower = stores("run-root")
    follower.join(1)
    follower.ack_teardown(1, 1)
    follower.ack_teardown("end", 1, code=1)
    post_failure(follower, 1, 1, {"cause": "crash", "rank": 3, "signal": "SIGKILL", "exit_code": -9, "step": 17})
    collateral = RankFailure(rank=0, exit_code=1, time=T0 + 5,
                             exception="RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:29500")
    world = ScriptedNodeWorld({1: [training(T0 + 4, 16), crashed(T0 + 5, 17)]},
                              failures_by_attempt={1: [collateral]}, job=leader)
    outcome = node_supervisor(world, max_restarts=0).supervise()
    [line] = [said for said in world.said if said.startswith("attempt 1 failed:")]
    assert line.startswith("attempt 1 failed: node 1, rank 3 was killed by SIGKILL"), line
    assert "here: rank 0: RuntimeError: [gloo] Connection closed by peer" in line, line
    [failure] = world.events("failure")
    root = failure["root_cause"]
    assert (root["node"], root["rank"], root["signal"]) == (1, 3, "SIGKILL"), failure
    assert outcome.code == 1 and "node 1, rank 3 was killed by SIGKILL" in outcome.message, outcome


def _follow(leader: JobStore, follower: JobStore, after_crash: Any) -> tuple[ScriptedNodeWorld, Outcome]:
    """Node 1 runs the loop in a thread; the test is the leader: attempt 1, then ``after_crash(leader)``."""
    world = ScriptedNodeWorld({1: [training(T0 + 4, 16), crashed(T0 + 5, 17)],
                               2: [training(T0 + 12, 10, first_step=None), training(T0 + 14, 30, agent_exit=0)]},
                              job=follower, node=1)
    result: list[Outcome] = []
    thread = threading.Thread(target=lambda: result.append(node_supervisor(world).supervise()), daemon=True)
    thread.start()
    assert wait_for(lambda: leader.node(1), timeout=20.0)  # joined: attempt 1 is the next one it runs
    leader.start_attempt(1, None, [0, 1])
    assert wait_for(lambda: leader.teardown_acks(1, [1]), timeout=20.0)  # it tore attempt 1 down and waits
    after_crash(leader)
    thread.join(timeout=20.0)
    assert result, "the follower did not end"
    return world, result[0]


def test_a_follower_relaunches_the_leaders_next_attempt_from_its_snapshot() -> None:
    leader, follower = stores("run-follow")
    snapshot = {"path": "/ckpt/step-000000010", "step": 10}
    world, outcome = _follow(leader, follower, lambda lead: lead.start_attempt(2, snapshot, [0, 1]))
    assert outcome.code == 0 and outcome.restarts == 1, outcome
    assert world.launches == [(1, None), (2, Path(snapshot["path"]))]
    assert leader.teardown_acks("end", [1])[1]["code"] == 0  # it told the leader it ended


def test_a_follower_ends_with_the_leaders_verdict() -> None:
    leader, follower = stores("run-verdict")
    message = "the restart budget (3) is spent"
    world, outcome = _follow(leader, follower, lambda lead: lead.set_verdict("gave_up", 1, message, hint="h", restarts=3))
    assert (outcome.code, outcome.message, outcome.hint, outcome.restarts) == (1, message, "h", 3)
    assert world.launches == [(1, None)] and leader.teardown_acks("end", [1])[1]["code"] == 1
