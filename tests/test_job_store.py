"""The job's store across nodes: a real TCPStore on 127.0.0.1, a leader and two clients in one process."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Iterator

import pytest

from ckptrun.cli.supervision.job_store import JobStore, NodeWatch, StoreUnreachable


@pytest.fixture(scope="module")
def stores() -> Iterator[tuple[JobStore, JobStore, JobStore]]:
    leader = JobStore.host("run-x", "127.0.0.1", 0)
    one = JobStore.connect("run-x", "127.0.0.1", leader.port, timeout_s=5)
    two = JobStore.connect("run-x", "127.0.0.1", leader.port, timeout_s=5)
    yield leader, one, two


def test_keys_live_under_the_run(stores: tuple[JobStore, JobStore, JobStore]) -> None:
    leader, one, _ = stores
    assert one.key("a3", "failure") == "ckptrun/run-x/a3/failure"
    assert leader.is_leader and not one.is_leader


def test_heartbeats_and_joins(stores: tuple[JobStore, JobStore, JobStore]) -> None:
    leader, one, two = stores
    assert leader.join(0) == 1 and one.join(1, host="h1") == 1
    assert one.join(1, host="h1") == 2  # a relaunched launcher of node 1: a new incarnation
    assert leader.node(1)["incarnation"] == 2 and leader.node(1)["host"] == "h1"
    one.beat(1, attempt=1, state="healthy")
    two.beat(2, attempt=1, state="starting")
    beats = leader.heartbeats([0, 1, 2])
    assert sorted(beats) == [1, 2] and beats[1]["state"] == "healthy"


def test_the_first_failure_of_an_attempt_wins(stores: tuple[JobStore, JobStore, JobStore]) -> None:
    leader, one, two = stores
    assert leader.failure(1) is None
    first = one.report_failure(1, node=1, ranks=[1], cause="crash", exit_code=-9)
    second = two.report_failure(1, node=2, ranks=[2], cause="crash")
    assert first["node"] == 1 and second == first and leader.failure(1) == first
    assert two.report_failure(2, node=2, ranks=[2], cause="hang")["node"] == 2  # each attempt has its own


def test_a_peers_connection_error_yields_to_the_node_where_the_rank_died(stores: tuple[JobStore, JobStore, JobStore]) -> None:
    """Node 0 sees only gloo's "Connection closed by peer" first; node 1, where the rank was SIGKILLed, reports
    later: its failure is the root cause, on both nodes."""
    import threading

    _, one, two = stores
    from ckptrun.cli.supervision.node_world import peer_error

    collateral = {"cause": "crash", "exception": "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:1234"}
    assert peer_error(collateral) and not peer_error({"cause": "crash", "signal": "SIGKILL"})
    seen: dict[str, dict] = {}
    yielding, looked = threading.Event(), one.failure

    def look(*args: object, **kwargs: object) -> dict | None:  # node 0's yield loop asks for a failure: it waits
        yielding.set()
        return looked(*args, **kwargs)

    one.failure = look  # type: ignore[method-assign]
    waiting = threading.Thread(target=lambda: seen.update(node0=one.report_failure(
        7, node=0, ranks=[0], cause="crash", yield_s=10.0, exception=collateral["exception"])))
    waiting.start()
    assert yielding.wait(20), "node 0 never began to yield"  # node 0 reported first and is waiting
    seen["node1"] = two.report_failure(7, node=1, ranks=[1], cause="crash", signal="SIGKILL")
    waiting.join(timeout=20)
    assert seen["node0"]["node"] == seen["node1"]["node"] == 1 and seen["node0"]["signal"] == "SIGKILL"


def test_teardown_acks_snapshot_attempt_and_verify(stores: tuple[JobStore, JobStore, JobStore]) -> None:
    leader, one, two = stores
    one.ack_teardown(1, 1)
    assert sorted(leader.teardown_acks(1, [0, 1, 2])) == [1]
    two.ack_teardown(1, 2, seconds=0.4)
    assert sorted(leader.teardown_acks(1, [0, 1, 2])) == [1, 2]
    snapshot = {"step": 10, "digest": "abc", "path": "/ckpt/step-000000010"}
    leader.start_attempt(2, snapshot, nodes=[0, 1, 2])
    assert one.attempt() == {**one.attempt(), "attempt": 2, "snapshot": snapshot, "nodes": [0, 1, 2]}
    one.post_verify(2, 1, True, files=3, seconds=0.1, problems=[])
    two.post_verify(2, 2, False, files=3, seconds=0.1, problems=["model.safetensors: digest mismatch"])
    verdicts = leader.verify_verdicts(2, [0, 1, 2])
    assert verdicts[1]["ok"] and not verdicts[2]["ok"] and 0 not in verdicts


def test_stop_requests_verdict_and_token(stores: tuple[JobStore, JobStore, JobStore]) -> None:
    leader, one, two = stores
    assert leader.stop_request() is None and one.verdict() is None
    assert two.request_stop(2, "signal SIGTERM")["node"] == 2
    assert one.request_stop(1, "stop requested")["node"] == 2  # the first request stands
    leader.set_verdict("stopped", 3, "stopped; newest verified snapshot: step 10", snapshot_step=10)
    assert (one.verdict()["action"], one.verdict()["code"]) == ("stopped", 3)
    leader.set_token("tok-1")
    assert two.token() == "tok-1"


def test_node_watch_judges_staleness_by_its_own_clock() -> None:
    watch = NodeWatch(timeout_s=5)
    watch.observe({1: {"time": 1000.0}, 2: {"time": 5.0}}, now=100.0)  # node clocks disagree: irrelevant
    watch.observe({1: {"time": 1001.0}, 2: {"time": 5.0}}, now=104.0)  # node 1 beat again, node 2 did not
    assert watch.stale([1, 2, 3], now=104.5, since=100.0) == []
    assert watch.stale([1, 2, 3], now=105.5, since=101.0) == [2]  # 5.5 s without a change; node 3 counts from 101
    assert watch.stale([1, 2, 3], now=106.5, since=101.0) == [2, 3]
    assert watch.stale([1], now=109.5, since=100.0) == [1]


def test_a_lost_leader_makes_every_call_fail() -> None:
    leader = JobStore.host("run-y", "127.0.0.1", 0)
    client = JobStore.connect("run-y", "127.0.0.1", leader.port, timeout_s=2)
    client.beat(1)
    port = leader.port
    del leader
    import gc

    gc.collect()
    with pytest.raises(StoreUnreachable):
        for _ in range(3):  # a set may still sit in the socket's buffer; a read cannot
            client.heartbeats([1])
    with pytest.raises(StoreUnreachable):
        client.wait_for([client.key("never")], 30.0)  # a wait fails at once too, not after its timeout
    with pytest.raises(StoreUnreachable):
        JobStore.connect("run-y", "127.0.0.1", port, timeout_s=1)


def test_the_store_module_does_not_import_torch_until_a_store_is_made() -> None:
    code = "import sys, ckptrun.cli.supervision.job_store; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_each_node_verifies_a_disjoint_share_and_a_bad_share_skips_the_snapshot_for_all(tmp_path) -> None:
    """The leader names a candidate; a follower thread answers for node 1; the newest snapshot has a flipped
    byte in node 1's share only, so node 1's verdict makes everyone fall back to the older one."""
    import threading

    from snapshot_factory import flip_byte, make_snapshot

    from ckptrun.cli.supervision.node_verify import answer, choose
    from ckptrun.runtime.manifest import read_manifest

    ckpt = tmp_path / "ckpt"
    make_snapshot(ckpt, 5)
    newest = make_snapshot(ckpt, 10)
    files = [e.path for e in read_manifest(newest).files]
    flip_byte(newest / files[1])  # file 1 of 3: node 1's share of two nodes (files 1), node 0 has files 0 and 2
    leader = JobStore.host("run-v", "127.0.0.1", 0)
    follower = JobStore.connect("run-v", "127.0.0.1", leader.port, timeout_s=5)
    done: set[int] = set()
    stop = threading.Event()

    def follow() -> None:
        while not stop.is_set():
            answer(follower, _latest_word(follower).get("verify"), 3, 1, done)
            stop.wait(0.02)

    thread = threading.Thread(target=follow)
    thread.start()
    said: list[str] = []
    try:
        chosen = choose(leader, 3, ckpt, [0, 1], 0, said.append)
    finally:
        stop.set()
        thread.join()
    assert chosen is not None and chosen.step == 5, said
    assert done == {1, 2}  # the follower verified its share of both candidates
    first = leader.verify_verdicts("3.1", [0, 1])
    assert first[0]["ok"] and first[0]["files"] == 2 and not first[1]["ok"] and first[1]["files"] == 1
    assert any("skipping step-000000010" in line and "node 1" in line for line in said), said


def _latest_word(job: JobStore) -> dict:
    told = job.news()
    return job.word(told) if told else {}


@pytest.mark.timeout(25)
def test_followers_send_their_share_with_the_teardown_ack_and_the_leader_asks_no_round_when_all_agree(tmp_path) -> None:
    """Issue 26: followers verify their share of the newest snapshot before they acknowledge the teardown; the
    leader takes those verdicts as round 1 and never names a candidate (no verify round, no follower answering).
    A bad share among them skips the snapshot for all, and round 2, on the older one, is asked as before."""
    import threading
    from types import SimpleNamespace

    from snapshot_factory import flip_byte, make_snapshot

    from ckptrun.cli.supervision.node_verify import answer, choose
    from ckptrun.runtime.manifest import read_manifest

    ckpt = tmp_path / "ckpt"
    make_snapshot(ckpt, 5)
    newest = make_snapshot(ckpt, 10)
    leader = JobStore.host("run-e", "127.0.0.1", 0)
    followers = {n: JobStore.connect("run-e", "127.0.0.1", leader.port, timeout_s=5) for n in (1, 2)}

    def ack(attempt: int) -> None:
        for node, store in followers.items():
            job = _node_job(store, node)
            job.world.ckpt_dir, job.world.run_id, job.world.active = ckpt, "run-e", [0, 1, 2]
            job.torn_down(SimpleNamespace(attempt=attempt, teardown_s=0.1))

    ack(3)
    said: list[str] = []
    chosen = choose(leader, 3, ckpt, [0, 1, 2], 0, said.append)  # nobody answers a round: none may be asked
    assert chosen is not None and chosen.step == 10, said
    assert leader.read(leader.key("a3", "verify")) is None and "verify" not in _latest_word(followers[1])
    verdicts = {n: a["verified"] for n, a in leader.teardown_acks(3, [1, 2]).items()}
    assert {n: (v["path"], v["files"], v["ok"]) for n, v in verdicts.items()} == {1: (str(newest), 1, True),
                                                                                  2: (str(newest), 1, True)}

    flip_byte(newest / read_manifest(newest).files[2].path)  # node 2's share of three nodes: file 2
    ack(4)
    done: dict[int, set[int]] = {1: set(), 2: set()}
    stop = threading.Event()

    def follow(node: int) -> None:
        while not stop.is_set():
            answer(followers[node], _latest_word(followers[node]).get("verify"), 4, node, done[node])
            stop.wait(0.02)

    threads = [threading.Thread(target=follow, args=(n,)) for n in (1, 2)]
    for thread in threads:
        thread.start()
    try:
        chosen = choose(leader, 4, ckpt, [0, 1, 2], 0, said.append)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert chosen is not None and chosen.step == 5, said
    assert done == {1: {2}, 2: {2}}  # round 1 came with the acks; round 2 was asked and answered
    assert any("skipping step-000000010" in line and "node 2" in line for line in said), said


# --- the multi-node job's decisions, on a real store (the world that would launch ranks is a stand-in) ---


def _node_job(job: JobStore, node: int, join_timeout: float = 20.0, poll: float = 0.02):
    """A NodeJob with only what its between-attempts code reads: the store is real, no ranks start."""
    from types import SimpleNamespace

    from ckptrun.cli.supervision.memory_tier import MemoryDir
    from ckptrun.cli.supervision.node_agent import NodeJob

    world = SimpleNamespace(job=job, node=node, settings=SimpleNamespace(leader=node == 0, spare=None), active=[node],
                            stop_file_present=lambda: False, say=lambda line: None, event=lambda name, **fields: None,
                            memory=MemoryDir(None), spares=None, memory_fetch={},  # no memory tier, no spares
                            spec=SimpleNamespace(node_cache_dir=None), watch=NodeWatch(60.0))  # no node cache
    timeouts = SimpleNamespace(poll=poll, startup=20.0, grace=30.0)
    return NodeJob(world, timeouts, SimpleNamespace(reason=lambda now, present: None), join_timeout)


def _in_thread(call):
    import threading

    result: list = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    return thread, result


def test_a_follower_takes_the_next_attempt_by_its_number_never_by_the_leaders_clock() -> None:
    """Finding 5: the leader's clock an hour behind the follower's; an attempt already running when the follower
    joins (or one that leaves it out) is not its; the next one listing it is."""
    from launch_helpers import wait_for

    leader = JobStore.host("run-n", "127.0.0.1", 0)
    follower = JobStore.connect("run-n", "127.0.0.1", leader.port, timeout_s=5)
    behind = time.time() - 3600.0

    def say_attempt(record: dict) -> None:  # as start_attempt says it, with the leader's clock an hour behind
        leader.put(leader.key("attempt"), record)
        leader._tell(attempt=record)

    say_attempt({"attempt": 3, "snapshot": None, "nodes": [0, 1], "time": behind})
    thread, result = _in_thread(lambda: _node_job(follower, 1).start(1, None))
    assert wait_for(lambda: leader.node(1), timeout=20.0)  # it joined after reading attempt 3
    say_attempt({"attempt": 4, "snapshot": None, "nodes": [0], "time": behind})  # not its
    snapshot = {"path": "/ckpt/step-000000010", "step": 10}
    say_attempt({"attempt": 5, "snapshot": snapshot, "nodes": [0, 1], "time": behind})
    thread.join(timeout=20.0)
    assert result and result[0][0] == 5 and result[0][1].step == 10


def test_a_quiet_node_that_beats_again_with_the_same_incarnation_counts_as_rejoined() -> None:
    """Finding 6: a network blip is not a lost launcher; a node that stays silent is still not back."""
    leader = JobStore.host("run-q", "127.0.0.1", 0)
    follower = JobStore.connect("run-q", "127.0.0.1", leader.port, timeout_s=5)
    follower.join(1)
    follower.beat(1, state="healthy")
    silent = _node_job(leader, 0, join_timeout=0.5)
    silent.incarnations = {1: 1}
    assert silent._wait_for_rejoin(1) is False  # no new beat, no new launcher within the join timeout
    waiting = _node_job(leader, 0)
    waiting.incarnations = {1: 1}
    thread, result = _in_thread(lambda: waiting._wait_for_rejoin(1))
    deadline = time.monotonic() + 20.0
    while thread.is_alive() and time.monotonic() < deadline:  # back: the same supervisor beats, as it does waiting
        follower.beat(1, state="waiting")
        time.sleep(0.05)
    thread.join(timeout=1.0)
    assert result == [True] and waiting.incarnations[1] == 1 and leader.node(1)["incarnation"] == 1


def test_a_follower_hashing_its_share_keeps_beating(tmp_path, monkeypatch) -> None:
    """Finding 6: a follower verifying a long share is not judged lost meanwhile."""
    from snapshot_factory import make_snapshot

    from ckptrun.cli.supervision import node_verify

    monkeypatch.setattr(node_verify, "BEAT_S", 0.0)  # a beat per chunk: the tiny snapshot hashes in milliseconds
    snapshot = make_snapshot(tmp_path / "ckpt", 5)
    leader = JobStore.host("run-b", "127.0.0.1", 0)
    follower = JobStore.connect("run-b", "127.0.0.1", leader.port, timeout_s=5)
    leader.ask_verify(2, 1, str(snapshot), [0, 1])
    node_verify.answer(follower, _latest_word(follower).get("verify"), 2, 1, set())
    assert leader.heartbeats([1])[1]["state"] == "verifying"
    assert leader.verify_verdicts("2.1", [0, 1])[1]["ok"]


def test_a_busy_coordination_port_is_refused_with_the_fix() -> None:
    """Finding 12: the leader cannot bind its store port: exit 2, one line, the --coord-port hint."""
    import socket

    from ckptrun.cli.errors import EXIT_REFUSED, CkptrunError
    from ckptrun.cli.supervision.many_nodes import host_job_store
    from ckptrun.cli.supervision.node_env import NodeSettings

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        settings = NodeSettings(nnodes="2", rdzv_endpoint="127.0.0.1:1", job_id="run-p", coord_port=port)
        with pytest.raises(CkptrunError) as error:
            host_job_store(settings)
    assert error.value.exit_code == EXIT_REFUSED and "--coord-port" in (error.value.hint or "")
    assert f"127.0.0.1:{port}" in error.value.message and "\n" not in error.value.message


def test_spares_join_beat_and_the_leader_promotes_a_live_one_which_then_holds_the_node(tmp_path) -> None:
    """Issue 25 item 5, the store's part: a spare joins (no node rank) and beats; the leader promotes the first
    live one to a lost node's rank (once: a second promotion of it is refused), waits for it to take the node
    (a higher incarnation naming the spare), and a relaunched launcher of that node rank then finds its rank
    held by the spare (so it joins as a spare in turn); a spare whose job ends meanwhile goes with the verdict."""
    import threading

    from ckptrun.cli.supervision import spares
    from ckptrun.cli.supervision.spares import SpareBench, held_by_spare, wait_for_promotion

    leader = JobStore.host("run-s", "127.0.0.1", 0)
    waiting = JobStore.connect("run-s", "127.0.0.1", leader.port, timeout_s=5)
    leader.join(0)
    leader.join(1)
    got: dict = {}
    thread = threading.Thread(target=lambda: got.update(zip(("spare", "node", "verdict"),
                                                             wait_for_promotion(waiting, tmp_path, lambda _: None))))
    thread.start()
    bench = SpareBench(leader, timeout_s=5.0)
    deadline = time.monotonic() + 20
    while not bench.live() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert bench.live() == [1] and [s["spare"] for s in spares.listed(tmp_path)] == [1]
    assert held_by_spare(leader, 1) is None, "node 1 is its own launcher's"

    def take() -> None:  # what the promoted spare's launcher does: join node 1's place, naming itself
        deadline = time.monotonic() + 20
        while got.get("node") is None and time.monotonic() < deadline:
            time.sleep(0.1)
        waiting.join(1, spare=got["spare"])

    taker = threading.Thread(target=take)
    taker.start()
    events: list = []
    assert bench.promote(1, attempt=3, before=1, event=lambda name, **f: events.append((name, f)), say=lambda _: None) == 2
    thread.join(20)
    taker.join(20)
    assert (got["spare"], got["node"], got["verdict"]) == (1, 1, None)
    assert [(name, f["spare"], f["node"], f["attempt"]) for name, f in events] == [("spare_promoted", 1, 1, 4)]
    assert held_by_spare(leader, 1) == 1, "a relaunched launcher of node 1 now finds it held by spare 1"
    assert bench.live() == [], "a promoted spare is no longer waiting"
    assert leader.promote_spare(1, 0, attempt=5)["node"] == 1, "a spare is promoted once"
    assert not spares.listed(tmp_path), "the promoted spare's holder file is gone"
    second: dict = {}
    other = threading.Thread(target=lambda: second.update(zip(("spare", "node", "verdict"),
                                                               wait_for_promotion(waiting, tmp_path, lambda _: None))))
    other.start()
    leader.set_verdict("done", 0, "the run completed")
    other.join(20)
    assert (second["spare"], second["node"], second["verdict"]["code"]) == (2, None, 0)


def test_the_leader_reads_every_node_in_a_constant_number_of_requests() -> None:
    """Issue 26: a read of N nodes' heartbeats, joins, acks or verdicts costs a few requests, not one or two per
    node (a family's index names the writers; known keys come in one multi_get); another client's first write is
    visible once it returned; a store without the extended API (torch < 2.1) gives the same answers key by key."""
    leader = JobStore.host("run-m", "127.0.0.1", 0)
    clients = [JobStore.connect("run-m", "127.0.0.1", leader.port, timeout_s=5) for _ in range(3)]
    for node, client in enumerate(clients, start=1):
        client.join(node)
        client.beat(node, attempt=4)
        if node != 2:
            client.ack_teardown(4, node)
        client.post_verify("4.1", node, True, files=1, seconds=0.0, problems=[])
    requests: list[str] = []
    real = leader._call
    leader._call = lambda method, *args: (requests.append(method), real(method, *args))[1]  # type: ignore[method-assign]
    many = range(1, 1000)
    for _ in range(2):  # unknown keys, then known ones: both cost no more than an index and a multi_get
        del requests[:]
        assert sorted(leader.heartbeats(many)) == [1, 2, 3] and len(requests) <= 3, requests
        del requests[:]
        assert sorted(leader.teardown_acks(4, many)) == [1, 3] and len(requests) <= 3, requests
        del requests[:]
        assert {n: d["incarnation"] for n, d in leader.nodes(many).items()} == {1: 1, 2: 1, 3: 1}
        assert len(requests) <= 3 and leader.verify_verdicts("4.1", many)[2]["ok"]
    clients[1].ack_teardown(4, 2)
    assert sorted(leader.teardown_acks(4, many)) == [1, 2, 3]
    slow = JobStore.connect("run-m", "127.0.0.1", leader.port, timeout_s=5)
    slow.batched = False
    assert slow.heartbeats([1, 2, 3, 4]) == leader.heartbeats([1, 2, 3, 4])
    assert slow.teardown_acks(4, [1, 2, 3, 4]) == leader.teardown_acks(4, [1, 2, 3, 4])
    assert slow.node(2) == leader.node(2) and slow.attempt() is None


LONG_POLL_S = 30.0  # longer than the test's timeout: a waiter that slept out its poll could not finish in time


@pytest.mark.timeout(25)
def test_each_hop_of_a_restart_wakes_on_its_key_not_on_the_next_poll(tmp_path) -> None:
    """Issue 26: with a 30 s poll everywhere, a node's sleep ends on another node's failure (asking the store, or
    on its failure alarm's event), the leader's wait on
    the last teardown ack, a follower's wait on the verify round (its verdict ends the leader's wait) and then on
    the next attempt. A wait that times out leaves the connection usable."""
    from snapshot_factory import make_snapshot

    from launch_helpers import wait_for

    from ckptrun.cli.supervision.failure_alarm import FailureAlarm
    from ckptrun.cli.supervision.node_world import NodeWorld

    leader = JobStore.host("run-w", "127.0.0.1", 0)
    follower = JobStore.connect("run-w", "127.0.0.1", leader.port, timeout_s=5)
    assert not follower.wait_for([follower.key("never")], 0.05) and follower.attempt() is None
    leader.start_attempt(1, None, [0, 1])
    world = NodeWorld.__new__(NodeWorld)  # only what its sleep reads: the store, the attempt, the failure alarm
    world.job, world.attempt, world.alarm = follower, 1, FailureAlarm(follower)  # not armed: asks the store
    sleeping, _ = _in_thread(lambda: world.sleep(LONG_POLL_S))
    leader.report_failure(1, node=0, ranks=[0], cause="crash")
    sleeping.join()
    world.attempt = 3  # armed: the alarm's thread holds the wait, the sleep waits on its event
    world.alarm.arm(3)
    assert wait_for(lambda: world.alarm.listening(3), timeout=20.0)
    sleeping, _ = _in_thread(lambda: world.sleep(LONG_POLL_S))
    leader.report_failure(3, node=0, ranks=[0], cause="crash")
    sleeping.join()
    assert world.alarm.take(3) and not world.alarm.take(3)  # rung once: the poll reads the failure then
    world.alarm.close()
    gathering = _node_job(leader, 0, poll=LONG_POLL_S)
    gathering.world.active = [0, 1]
    acks, _ = _in_thread(lambda: gathering._wait_for_acks(1))
    follower.ack_teardown(1, 1)
    acks.join()
    following, result = _in_thread(lambda: _node_job(follower, 1, poll=LONG_POLL_S).follow(1))
    leader.ask_verify(1, 1, str(make_snapshot(tmp_path / "ckpt", 5)), [0, 1])
    assert leader.wait_for_verdicts("1.1", [1], LONG_POLL_S) and leader.verify_verdicts("1.1", [1])[1]["ok"]
    leader.start_attempt(2, None, [0, 1])
    following.join()
    assert result == [(2, None)]
