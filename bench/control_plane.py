"""The many-node control plane at N nodes: ckptrun's real leader code against N-1 simulated nodes on 127.0.0.1.

    python bench/control_plane.py --nodes 8,64,256,1024 [--repeats 10] [--warmup 1] [--json]

Real code, not a re-implementation (no ranks, torchrun or run dir). **The leader** (its own process, node 0)
hosts the store (``JobStore.host``), runs ``NodeJob.start`` (join, wait for every node, attempt 1), then its
supervisor's poll loop: ``NodeWorld.sync`` (the failure when its ``FailureAlarm`` rang; once a second its beat, a
stop, every heartbeat through ``NodeWatch``, ``SpareBench.observe``), ``NodeWorld.sleep(Timeouts().poll)`` (on the
alarm's event) and, on another node's failure, its supervisor's path between attempts: ``NodeJob.root_cause`` and
the failure event's ``post_failure``, ``NodeJob.torn_down``, ``NodeJob.gather`` (every ack; silent, relaunched, lost
nodes), ``RestartPolicy.verdict`` (a first restart's facts: no back-off), ``NodeWorld.newest_snapshot``
(``node_verify.choose`` over a small published snapshot: round 1 from the verdicts the acks carry, or a verify
round) and ``NodeJob.restarting``. **Every other node** is a thread (``--agents-per-proc`` per forked process)
with a ``JobStore.connect`` client (and its failure alarm's) doing what its launcher does with the store: connect
and read the token as ``many_nodes._join`` does, ``NodeJob.start``, then ``NodeWorld.sync`` and ``NodeWorld.sleep``
in turn; told to fail, it reports a SIGKILLed rank (``NodeJob.root_cause``); seeing another node's failure it
posts its collateral one (known already: no request), then ``NodeJob.torn_down`` (its share of the newest snapshot
verified by ``node_verify.early_share``, sent with the ack) and ``NodeJob.follow`` (``_next_attempt``: a wait on
the leader's next word, ``news/<n>``, and one read of it; a verify round's share by ``node_verify.answer``); a lost
leader ends it as ``LeaderLost`` after ``LEADER_LOST_S``. Both build ``NodeWorld`` without
``LocalWorld.__init__`` (only what its store code reads) and repeat ``NodeWorld.launch``'s store part per attempt.

Figures and keys: bench/README.md. Goal: failure → every node read the next attempt, p99 <= 1 s at 1024 nodes
(PASS/MISS), over the failures after ``--warmup`` (each simulated node's first pass down the restart path, reported
as ``cold_failure_to_decision_s``). Table to stdout (``--json``: JSON), progress to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import queue
import random
import resource
import signal
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ckptrun.cli.supervision.failure_alarm import FailureAlarm
from ckptrun.cli.supervision.job_store import LEADER_LOST_S, JobStore, NodeWatch, StoreUnreachable
from ckptrun.cli.supervision.many_nodes import JOIN_POLL_S
from ckptrun.cli.supervision.memory_tier import MemoryDir
from ckptrun.cli.supervision.node_agent import NodeJob
from ckptrun.cli.supervision.node_world import LeaderLost, NodeWorld, post_failure
from ckptrun.cli.supervision.observation import AttemptWatch
from ckptrun.cli.supervision.policy import RestartFacts, RestartPolicy, Timeouts
from ckptrun.cli.supervision.spares import SpareBench

HOST, TIMEOUTS = "127.0.0.1", Timeouts()  # the real defaults: poll 0.2 s
NODE_TIMEOUT = max(5.0, min(TIMEOUTS.heartbeat, 30.0))  # as runner.py derives it from --heartbeat-timeout
GOAL_NODES, GOAL_S = 1024, 1.0
RESOLVER = "timeout:1 attempts:1"  # c10d looks up every new connection's peer name (README: control_plane.py)
NO_STOP = SimpleNamespace(reason=lambda now, present: None)
START_S, TRIAL_S, STEADY_S = 300.0, 60.0, 3.0


class Counting(JobStore):
    """The real JobStore, counting its requests (``get``: a wait and the get; a timed-out wait: it and its cancel);
    ``clients``: every one of this process (a node's own and its failure alarm's)."""

    ops = 0
    clients: list["Counting"] = []

    def __post_init__(self) -> None:
        super().__post_init__()
        Counting.clients.append(self)

    def _call(self, method: str, *args: Any) -> Any:
        self.ops += 2 if method == "get" else 1
        try:
            return super()._call(method, *args)
        except TimeoutError:
            self.ops += 1
            raise


class TimedJob(NodeJob):
    t_acks = 0.0  # the real NodeJob, noting when its wait for the teardown acks returned

    def _wait_for_acks(self, attempt: int) -> None:
        super()._wait_for_acks(attempt)
        self.t_acks = time.monotonic()


def bare_world(job: JobStore, node: int, n: int, ckpt_dir: Path, leader: bool) -> NodeWorld:
    """A NodeWorld without ranks: what its store code reads (``LocalWorld.__init__`` would build a run)."""
    world = NodeWorld.__new__(NodeWorld)
    world.settings = SimpleNamespace(leader=leader, node_rank=node, spare=None, max_nodes=n, min_nodes=n)
    world.job, world.node, world.nodes, world.active = job, node, list(range(n)), list(range(n))
    world.watch, world.memory, world.memory_fetch = NodeWatch(NODE_TIMEOUT), MemoryDir(None), {}
    world.remote_failure = world.remote_stop = world.unreachable_since = world.verify_for = None
    world.alarm, world.synced = FailureAlarm(job), float("-inf")
    world.spares = SpareBench(job, NODE_TIMEOUT) if leader else None
    world.ckpt_dir, world.run_id, world.attempt, world.launched = ckpt_dir, job.run_id, 0, 0.0
    world.spec = SimpleNamespace(store_url=None, allow_reshard=False, node_cache_dir=None)  # no --local-cache
    world.say, world.event = (lambda line: None), (lambda name, **fields: None)
    world.stop_file_present = lambda: False  # type: ignore[method-assign]
    return world


def relaunch(world: NodeWorld, attempt: int) -> AttemptWatch:
    """NodeWorld.launch's store part: the attempt number, its start, no failure seen yet, the failure alarm armed
    for it, a fresh watch."""
    world.attempt, world.launched, world.remote_failure = attempt, time.time(), None
    world.alarm.arm(attempt)
    world.watch = NodeWatch(world.watch.timeout_s)
    return AttemptWatch(attempt, world.launched, None)


def raise_nofile(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need if hard == resource.RLIM_INFINITY else min(need, hard), hard))


def cpu_s() -> float:
    return sum(resource.getrusage(resource.RUSAGE_SELF)[:2])  # user + system


def pct(values: list[float], q: float) -> float | None:  # nearest rank: the p99 of 10 samples is the largest
    return sorted(values)[max(0, math.ceil(q * len(values)) - 1)] if values else None


def leader_main(conn: Connection, n: int, run_id: str, ckpt_dir: Path) -> None:
    raise_nofile(2 * n + 256)  # every node's client and its failure alarm's
    job = Counting.host(run_id, HOST, 0)
    job.set_token("bench-token")  # as many_nodes._publish_token: before the others join
    world = bare_world(job, 0, n, ckpt_dir, leader=True)
    node_job = TimedJob(world, TIMEOUTS, NO_STOP, join_timeout=NODE_TIMEOUT)
    conn.send(("port", job.port))
    if not conn.poll(START_S) or not conn.recv():  # go
        return
    cpu0, attempt, polls = cpu_s(), 1, []
    node_job.start(attempt, None)  # returns once every node joined and attempt 1 is published
    conn.send(("joined", time.monotonic()))
    watch = relaunch(world, attempt)
    while True:
        started = time.monotonic()
        world.sync(time.time())
        polls.append(time.monotonic() - started)
        if world.remote_failure is not None:
            conn.send(("decided", attempt, *decide(world, node_job, watch)))
            attempt += 1
            watch = relaunch(world, attempt)
            continue
        world.sleep(TIMEOUTS.poll)  # the supervisor's sleep: the attempt's failure key ends it
        if conn.poll(0):  # the harness asked for figures meanwhile
            conn.recv()
            conn.send(("stats", sum(c.ops for c in Counting.clients), cpu_s() - cpu0, polls))
            polls = []


def decide(world: NodeWorld, node_job: TimedJob, watch: AttemptWatch) -> tuple[float, ...]:
    """The leader's supervisor from seeing another node's failure to publishing the next attempt."""
    seen, attempt = time.monotonic(), watch.attempt
    watch.failure = {"cause": "crash", "signal": "SIGTERM", "rank": 0}  # its ranks, torn down by the remote failure
    node_job.root_cause(watch)
    post_failure(world.job, attempt, 0, watch.failure)  # NodeWorld.event("failure") posts it too
    node_job.torn_down(watch)
    gave_up, gathered = node_job.gather(watch), time.monotonic()
    RestartPolicy().verdict(RestartFacts(first_attempt=False, reached_first_step=True, load_failure=False,
                                         restarts=0, stalled_restarts=0))
    world.verify_for = attempt
    snapshot = world.newest_snapshot()  # node_verify.choose: every node verifies its share
    if gave_up is not None or snapshot is None:  # a node judged lost, or no snapshot verified
        raise RuntimeError(f"attempt {attempt}: {gave_up or 'no snapshot verified'}")
    verified = time.monotonic()
    node_job.restarting(watch, snapshot, None)
    return seen, node_job.t_acks, gathered, verified


def agents_main(conn: Connection, nodes: list[int], n: int, port: int, run_id: str, ckpt_dir: Path) -> None:
    raise_nofile(2 * len(nodes) + 256)
    threading.stack_size(512 * 1024)
    shared = SimpleNamespace(go=threading.Event(), events=queue.SimpleQueue(), failing=set(), n=n,
                             port=port, run_id=run_id, ckpt_dir=ckpt_dir)
    for thread in (threads := [threading.Thread(target=agent, args=(node, shared), daemon=True) for node in nodes]):
        thread.start()
    conn.send(("ready",))
    cpu0 = 0.0
    while any(t.is_alive() for t in threads) or not shared.events.empty():
        if conn.poll(0.05):
            command = conn.recv()
            if command[0] == "go":
                cpu0 = cpu_s()
                shared.go.set()
            elif command[0] == "fail":  # at its next poll: the figures count from its report
                shared.failing.add(command[1])
            else:
                conn.send(("stats", sum(c.ops for c in Counting.clients), cpu_s() - cpu0))
        if batch := [shared.events.get() for _ in range(shared.events.qsize())]:
            conn.send(("events", batch))
    conn.send(("done", cpu_s() - cpu0))


def agent(node: int, shared: SimpleNamespace) -> None:
    """One node's launcher, as far as the store sees it."""
    if not shared.go.wait(START_S):
        return
    deadline, say = time.monotonic() + START_S, shared.events.put
    try:
        while True:  # as many_nodes._join connects: retried until the start-up allowance ends
            try:
                job = Counting.connect(shared.run_id, HOST, shared.port, timeout_s=5.0)
                break
            except StoreUnreachable:
                if time.monotonic() > deadline:
                    raise
        while job.token() is None and time.monotonic() < deadline:  # many_nodes._join
            time.sleep(JOIN_POLL_S)
        world = bare_world(job, node, shared.n, shared.ckpt_dir, leader=False)
        node_job = NodeJob(world, TIMEOUTS, NO_STOP, join_timeout=NODE_TIMEOUT)
        step = node_job.start(1, None)
        say(("started", node, 0, time.monotonic()))
        while isinstance(step, tuple):
            watch = relaunch(world, step[0])
            while True:
                if node in shared.failing:  # its rank died: its supervisor reports the root cause
                    shared.failing.discard(node)
                    watch.failure = {"cause": "crash", "signal": "SIGKILL", "rank": node, "exit_code": -9}
                    say(("failed", node, watch.attempt, time.monotonic()))
                    break
                world.sync(time.time())
                if world.remote_failure is not None:  # another node's: its ranks torn down, a collateral failure
                    watch.failure = {"cause": "crash", "signal": "SIGTERM", "rank": node}
                    break
                world.sleep(TIMEOUTS.poll)
            node_job.root_cause(watch)
            post_failure(job, watch.attempt, node, watch.failure)  # NodeWorld.event("failure")
            node_job.torn_down(watch)
            say(("acked", node, watch.attempt, time.monotonic()))
            step = node_job.follow(watch.attempt)
            say(("next", node, step[0] if isinstance(step, tuple) else -1, time.monotonic()))
    except LeaderLost:
        say(("lost", node, 0, time.monotonic()))
    except StoreUnreachable as exc:
        say(("error", node, 0, str(exc)))


class Harness:
    """The processes for one N and their reports (``said``: the leader's port, join, decisions; agents' ready, done)."""

    def __init__(self) -> None:
        self.ctx, self.procs, self.conns = mp.get_context("fork"), [], []
        self.events: dict[str, dict[tuple[int, int], Any]] = {k: {} for k in ("started", "failed", "acked", "next", "lost")}
        self.said: dict[Connection, list[tuple]] = {}  # and the latest stats of each, the agent process of each node
        self.stats, self.owner = {}, {}

    def start(self, n: int, ckpt_dir: Path, per_proc: int) -> None:
        run_id = f"bench-cp-{n}-{os.getpid()}"
        leader = self._spawn(leader_main, n, run_id, ckpt_dir)
        self.pump(lambda: self.said.get(leader), 120.0, "the leader's store")
        others = list(range(1, n))
        for group in (others[i:i + per_proc] for i in range(0, len(others), per_proc)):
            self.owner.update(dict.fromkeys(group, self._spawn(agents_main, group, n, self.said[leader][0][1], run_id,
                                                               ckpt_dir)))
        self.pump(lambda: all(self.said.get(c) for c in self.conns), 120.0, "the agents' start")

    def _spawn(self, target: Any, *args: Any) -> Connection:
        mine, theirs = self.ctx.Pipe()
        self.procs.append(self.ctx.Process(target=target, args=(theirs, *args), daemon=True))
        self.procs[-1].start()
        self.conns.append(mine)
        return mine

    def pump(self, until: Any, timeout: float, what: str) -> None:
        """Take in every report until ``until()`` holds; a TimeoutError names ``what`` after ``timeout``."""
        deadline, conns = time.monotonic() + timeout, list(self.conns)
        while not until():
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{what}: not within {timeout:g}s {list(self.events.get('error', {}).values())[:3]}")
            for conn in wait(conns, timeout=min(0.5, max(0.0, deadline - time.monotonic()))):
                try:
                    message = conn.recv()
                except EOFError:
                    conns.remove(conn)
                    continue
                if message[0] == "events":
                    for kind, node, attempt, value in message[1]:
                        self.events.setdefault(kind, {})[(node, attempt)] = value  # "error": its message
                elif message[0] == "stats":
                    self.stats[conn] = message
                else:
                    self.said.setdefault(conn, []).append(message)

    def sample(self) -> dict[str, Any]:
        """Every process's requests and CPU seconds, at about one moment."""
        self.stats = {}
        for conn in self.conns:
            conn.send(("stats",))
        self.pump(lambda: len(self.stats) == len(self.conns), 30.0, "stats")
        got = [self.stats[conn] for conn in self.conns]
        return {"t": time.monotonic(), "ops": sum(m[1] for m in got), "cpu": got[0][2], "polls": got[0][3],
                "agents_cpu": sum(m[2] for m in got[1:])}

    def close(self) -> None:
        """The leader first (its loss ends every agent), then whatever is left after a bounded wait."""
        for process in self.procs[:1]:
            process.kill()
        deadline = time.monotonic() + LEADER_LOST_S + 10.0
        for process in self.procs:
            process.join(timeout=max(0.1, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(timeout=10.0)


def measure(n: int, repeats: int, ckpt_dir: Path, per_proc: int, warmup: int = 1) -> dict[str, Any]:
    rng, out = random.Random(n), {"nodes": n, "load_start": os.getloadavg()[0]}
    harness = Harness()
    events, of = harness.events, lambda kind, attempt: [t for (_, a), t in harness.events[kind].items() if a == attempt]
    try:
        harness.start(n, ckpt_dir, per_proc)
        said = harness.said[harness.conns[0]]  # the leader's: port, joined, decided…
        go = time.monotonic()
        for conn in harness.conns:
            conn.send(("go",))
        harness.pump(lambda: len(said) > 1 and len(events["started"]) == n - 1, START_S, "join")
        out.update(joined=1 + len(events["started"]), join_s=said[1][1] - go,
                   first_attempt_s=max(events["started"].values()) - go)
        print(f"  {n} nodes joined in {out['join_s']:.2f}s", file=sys.stderr, flush=True)
        a = harness.sample()
        harness.pump(lambda: time.monotonic() - a["t"] >= STEADY_S, STEADY_S + 5, "steady")
        b = harness.sample()
        span = b["t"] - a["t"]
        out.update(ops_per_s=(b["ops"] - a["ops"]) / span,
                   leader_cpu_steady=(b["cpu"] - a["cpu"]) / span, agents_cpu_steady=(b["agents_cpu"] - a["agents_cpu"]) / span,
                   leader_poll_s_p50=pct(b["polls"], 0.5), leader_poll_s_max=max(b["polls"]))
        trials: dict[str, list[float]] = {}
        cold: list[float] = []  # the first failures: every simulated node's first pass down these paths
        for attempt in range(1, warmup + repeats + 1):
            node = rng.randrange(1, n)
            harness.owner[node].send(("fail", node))
            harness.pump(lambda: len(said) > attempt + 1 and len(of("next", attempt + 1)) == n - 1,
                         TRIAL_S, f"failure {attempt}")
            t0, (_, _, seen, acks, gathered, verified) = events["failed"][(node, attempt)], said[attempt + 1]
            if attempt <= warmup:
                cold.append(max(of("next", attempt + 1)) - t0)
                print(f"  failure {attempt} (warm-up, not in the percentiles): {cold[-1]:.3f}s", file=sys.stderr, flush=True)
            else:
                for key, value in (("failure_to_decision", max(of("next", attempt + 1)) - t0),
                                   ("ack", acks - max(of("acked", attempt))), ("leader_seen", seen - t0),
                                   ("leader_acks", acks - t0), ("leader_gathered", gathered - t0),
                                   ("leader_verified", verified - t0)):
                    trials.setdefault(key, []).append(value)
                print(f"  failure {attempt - warmup}/{repeats}: {trials['failure_to_decision'][-1]:.3f}s",
                      file=sys.stderr, flush=True)
            settle = time.monotonic() + rng.uniform(0.2, 0.4)  # the next failure at another phase of the polls
            harness.pump(lambda: time.monotonic() >= settle, 5.0, "settle")
        for key, values in trials.items():
            out[f"{key}_s_p50"], out[f"{key}_s_p99"] = pct(values, 0.5), pct(values, 0.99)
        c = harness.sample()
        extra = c["agents_cpu"] - b["agents_cpu"] - out["agents_cpu_steady"] * (c["t"] - b["t"])
        out.update(agents_cpu_per_failure_s=extra / max(1, warmup + repeats), leader_cpu_s=c["cpu"],
                   cold_failure_to_decision_s=max(cold, default=None))
        killed = time.monotonic()
        harness.procs[0].kill()  # the leader's host is gone: every connection to its store closes
        harness.pump(lambda: len(events["lost"]) == n - 1, LEADER_LOST_S + 30.0, "leader loss")
        lost = [t - killed for t in events["lost"].values()]
        out.update(leader_loss_s_p50=pct(lost, 0.5), leader_loss_s_max=max(lost),
                   failure_to_decision_samples=[round(v, 4) for v in trials.get("failure_to_decision", [])])
        harness.pump(lambda: all(len(harness.said.get(c, [])) > 1 for c in harness.conns[1:]), 30.0, "the agents' end")
    finally:
        harness.close()
    out["load"] = f"{out.pop('load_start'):.1f}->{os.getloadavg()[0]:.1f}"
    return out


def tiny_snapshot(ckpt_dir: Path) -> None:
    """One published snapshot of three small files (the tests' factory: the writer's layout and manifest): a
    node's verify share is one file or none, so the round measures the protocol, not hashing."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from snapshot_factory import make_snapshot
    make_snapshot(ckpt_dir, 10)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--nodes", default="8,64,256,1024")
    parser.add_argument("--repeats", type=int, default=10, help="failures per N (p50/p99 over them)")
    parser.add_argument("--agents-per-proc", type=int, default=64,
                        help="simulated nodes (threads) per process (more share one GIL: 128 doubles their CPU)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="failures first, reported as cold_failure_to_decision_s, not in the percentiles")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`: the finally blocks end the children
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"  # c10d's warnings; torch is imported once, before the forks
    os.environ.setdefault("RES_OPTIONS", RESOLVER)
    import torch.distributed  # noqa: F401
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ckptrun-cp-") as scratch:
        tiny_snapshot(Path(scratch) / "ckpt")
        for n in (int(x) for x in args.nodes.split(",")):
            print(f"{n} nodes (load {os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)
            try:
                results[str(n)] = measure(n, args.repeats, Path(scratch) / "ckpt", args.agents_per_proc, args.warmup)
            except (TimeoutError, RuntimeError) as exc:
                results[str(n)] = {"nodes": n, "error": f"{type(exc).__name__}: {exc}"[:300]}
                print(f"  {n} nodes: {results[str(n)]['error']}", file=sys.stderr, flush=True)
    value = results.get(str(GOAL_NODES), {}).get("failure_to_decision_s_p99")
    goal = {"metric": "failure_to_decision_s_p99", "nodes": GOAL_NODES, "limit_s": GOAL_S, "value": value,
            "status": "n/a" if value is None else ("PASS" if value <= GOAL_S else "MISS"),
            "resolver": os.environ["RES_OPTIONS"], "cpus": os.cpu_count()}
    if args.json:
        print(json.dumps({"nodes": results, "goal": goal}, indent=1))
        return 0
    keys = [k for row in results.values() for k, v in row.items() if isinstance(v, (int, float)) and k != "nodes"]
    print("key".ljust(28) + "".join(f"{n:>10}" for n in results))
    for key in [*dict.fromkeys(keys), "load"]:
        cells = [row.get(key) for row in results.values()]
        print(key.ljust(28) + "".join(f"{c if isinstance(c, str) else '-' if c is None else f'{c:.0f}' if c >= 100 or c == int(c) else f'{c:.3f}':>10}"
                                      for c in cells))
    print("".join(f"{n} nodes: {row['error']}\n" for n, row in results.items() if "error" in row), end="")
    print(f"goal: failure_to_decision_s p99 <= {GOAL_S:g}s at {GOAL_NODES} nodes: "
          + (f"{value:.3f}s {goal['status']}" if value is not None else "not measured"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
