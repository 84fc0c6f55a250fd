"""One node of a multi-node job: the local world (this node's torchrun tree) plus the job's store.

:class:`NodeWorld` is a :class:`~ckptrun.cli.supervision.world.LocalWorld` whose
attempts join a job-wide c10d rendezvous (a fresh ``--rdzv-id <job>-a<N>`` per
attempt, torchrun's shared worker store off) and whose every poll also
beats this node's heartbeat into the store and reads what other nodes said:
a failure of this attempt anywhere tears the local ranks down at once; a
stop asked on any node becomes this node's stop. The leader also judges the
other nodes' heartbeats: a silent node's supervisor is a failure of the
attempt ("node lost"). Its sleep between polls ends on the attempt's
failure key (a :class:`~ckptrun.cli.supervision.failure_alarm.FailureAlarm`
holds one long wait on it), so a failure on any node wakes every node in one
round trip; the beat, the stop and the other nodes' heartbeats, judged
against a node timeout of 5 s or more, are read every :data:`SYNC_EVERY_S`.
A client that cannot reach the store for :data:`LEADER_LOST_S` raises
:class:`LeaderLost`. Per-node files (logs, lock, holder) live under
``RUN_DIR/nodes/node-<k>/``: one writer per file.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptrun.cli.supervision.failure_alarm import FailureAlarm
from ckptrun.cli.supervision.job import JobLost
from ckptrun.cli.supervision.job_store import LEADER_LOST_S, JobStore, NodeWatch, StoreUnreachable
from ckptrun.cli.supervision.node_env import NodeSettings
from ckptrun.cli.supervision.node_verify import choose
from ckptrun.cli.supervision.observation import Observation, Snapshot
from ckptrun.cli.supervision.rundir import RunPaths
from ckptrun.cli.supervision.spares import SpareBench, standby_label
from ckptrun.cli.supervision.world import LocalWorld
from ckptrun.runtime import records
from ckptrun.runtime.env import RunEnv

RANKS_NAME = "ranks.json"  # in nodes/node-k: the global ranks this node runs in its current attempt
SYNC_EVERY_S = 1.0  # beat, stop and (leader) heartbeats: a node is stale after >= 5 s without a beat
RUN_EVENTS = ("attempt_start", "restart", "run_completed", "run_stopped", "gave_up")  # the leader's alone


def newest_in_memory(own: dict[int, list[int]], replicas: dict[int, dict[int, dict[int, int]]],
                     floor: int) -> tuple[int | None, dict[int, dict[str, int]]]:
    """The newest step above ``floor`` of which every node's shards are in memory somewhere: its own copy, or a
    replica another node holds; and, for each node without its own copy, the node to fetch it from (the first
    holder) and its bytes. ``(None, {})`` when no such step exists."""
    held = {s for steps in own.values() for s in steps} | \
        {s for of in replicas.values() for steps in of.values() for s in steps}
    for step in sorted((s for s in held if s > floor), reverse=True):
        fetch: dict[int, dict[str, int]] = {}
        for node in own:
            if step in own[node]:
                continue
            holder = next((h for h in sorted(replicas) if h != node and step in replicas[h].get(node, {})), None)
            if holder is None:
                break
            fetch[node] = {"from": holder, "bytes": replicas[holder][node][step]}
        else:
            return step, fetch
    return None, {}


class LeaderLost(JobLost):
    """The leader's store went away: this node tears down and exits with the requeue code."""


@dataclass(frozen=True)
class NodePaths(RunPaths):
    """A run directory seen from node ``node``: shared records at the root, this node's files in ``nodes/node-k``."""

    node: int = 0

    @property
    def node_dir(self) -> Path:
        return self.root / "nodes" / f"node-{self.node}"

    @property
    def logs(self) -> Path:
        return self.node_dir / "logs"

    @property
    def holder_file(self) -> Path:
        return self.node_dir / "supervisor.json"

    @property
    def lock_file(self) -> Path:
        return self.node_dir / ".lock"

    @property
    def ranks_file(self) -> Path:
        return self.node_dir / RANKS_NAME


def rdzv_id(job_id: str, attempt: int) -> str:
    """A fresh rendezvous per attempt: a closed rendezvous id cannot be joined again."""
    return f"{job_id}-a{attempt}"


class NodeWorld(LocalWorld):
    """This node's attempts, coordinated with the other nodes through the job's store."""

    def __init__(self, *args: Any, settings: NodeSettings, job: JobStore, node_timeout: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.settings, self.job, self.node = settings, job, settings.node_rank
        self.nodes = list(range(settings.max_nodes))
        self.active = list(self.nodes)  # the nodes of the current attempt (fewer after an elastic shrink)
        self.watch = NodeWatch(node_timeout)
        self.remote_failure: dict[str, Any] | None = None
        self.remote_stop: dict[str, Any] | None = None
        self.unreachable_since: float | None = None
        self.verify_for: int | None = None  # set when the leader picks a restart's snapshot
        self.placed = 0  # the attempt whose ranks were written to nodes/node-k/ranks.json
        self.resumed_from_memory = False  # the current attempt restores this node's memory copy
        self.memory_fetch: dict[int, dict[str, int]] = {}  # the next attempt's fetches from replicas: node -> holder, bytes
        self.spares = SpareBench(job, node_timeout, self.event) if settings.leader else None  # launchers waiting to replace a node
        self.alarm, self.synced = FailureAlarm(job), float("-inf")  # the last full sync (monotonic)

    # --- launching ---

    def launch(self, attempt: int, resume_from: Path | None) -> None:
        """torchrun reads ``PET_<FLAG>`` for a flag it is not given: the attempt's rendezvous id and who hosts it."""
        os.environ.update({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PET_RDZV_ID": rdzv_id(self.settings.job_id or "", attempt),
                           "PET_RDZV_CONF": f"is_host={int(self.settings.leader)}"})
        self.remote_failure = None
        self.alarm.arm(attempt)
        self.resumed_from_memory = self.memory.holds(resume_from)
        self.spec = self.spec.model_copy(update={"nnodes": str(len(self.active))})  # torchrun's: this attempt's nodes
        super().launch(attempt, resume_from)
        self.watch = NodeWatch(self.watch.timeout_s)

    def run_env(self, attempt: int, resume_from: Path | None) -> RunEnv:
        """The single-node contract plus this node's rank: the teardown sweep matches (run id, node)."""
        fetch = {node: int(peer["from"]) for node, peer in self.memory_fetch.items()}
        return super().run_env(attempt, resume_from).model_copy(update={"node": self.node, "memory_fetch": fetch})

    # --- observing ---

    def sleep(self, seconds: float) -> None:
        """Between two polls: a failure of this attempt reported on any node ends the sleep at once (the next
        poll reads it); once this node has read it, or without the store, a plain sleep."""
        if self.alarm.listening(self.attempt):
            self.alarm.wait(seconds)
            return
        until = time.monotonic() + seconds
        with contextlib.suppress(StoreUnreachable):  # the next poll's sync counts how long it is unreachable
            if self.job.wait_for_failure(self.attempt, seconds):
                return
        super().sleep(max(0.0, until - time.monotonic()))

    def observe(self) -> Observation:
        obs = super().observe()
        if obs.ranks and self.placed != self.attempt:  # which global ranks run here: for `ckptrun status`
            self.placed = self.attempt
            self.paths.ranks_file.write_text(json.dumps({"attempt": self.attempt, "ranks": sorted(obs.ranks),
                                                         "host": socket.gethostname()}))
        self.sync(obs.time)
        if self.remote_failure is not None and obs.agent_exit is None:
            self.say(f"attempt {self.attempt} failed on node {self.remote_failure.get('node')} "
                     f"({self.remote_failure.get('cause')}): tearing this node's ranks down")
            self.teardown(failed=True)
            obs.agent_exit = self._process().exit_code()
        obs.stop_file = obs.stop_file or self.remote_stop is not None
        return obs

    def sync(self, now: float) -> None:
        """Beat; read this attempt's first failure and any stop; the leader also watches the other nodes. The
        failure is read when the alarm rang (or does not listen yet), the rest every :data:`SYNC_EVERY_S`."""
        due, rang = time.monotonic() - self.synced >= SYNC_EVERY_S, self.alarm.take(self.attempt)
        ask = rang or not self.alarm.listening(self.attempt)  # a listening alarm's silence: no failure yet
        if not (due or ask):
            return
        try:
            failure = self.job.failure(self.attempt, exists=rang) if ask else None
            if due:
                self.synced = time.monotonic()
                self.job.beat(self.node, attempt=self.attempt, pid=os.getpid())
                self.remote_stop = self.remote_stop or self.job.stop_request()
                if self.settings.leader:
                    failure = failure or self._lost_node(now)
                    self.spares.observe()  # type: ignore[union-attr]  # a spare's beat that stops is stale
            self.unreachable_since = None
        except StoreUnreachable as exc:
            self.unreachable_since = self.unreachable_since or now
            if now - self.unreachable_since >= LEADER_LOST_S:
                raise LeaderLost(str(exc)) from None
            return
        lost_here = failure is not None and failure.get("cause") == "node lost"  # judged lost: tear down too
        if failure is not None and (failure.get("node") != self.node or lost_here):
            self.remote_failure = failure

    def _lost_node(self, now: float) -> dict[str, Any] | None:
        others = [n for n in self.active if n != self.node]
        self.watch.observe(self.job.heartbeats(others), now)
        stale = self.watch.stale(others, now, since=self.launched)
        if not stale:
            return None
        detail = f"node {stale[0]}'s supervisor stopped beating for {self.watch.timeout_s:g}s"
        detect_s = now - self.watch.seen.get(stale[0], (0.0, self.launched))[1]  # since its last beat, our clock
        first = self.job.report_failure(self.attempt, node=stale[0], ranks=[], cause="node lost", detail=detail,
                                        detect_s=detect_s)
        if first.get("cause") == "node lost" and first.get("node") == stale[0]:
            super().event("failure", node=stale[0], attempt=self.attempt, cause="node lost", exception=detail,
                          detected_at=now, detect_s=detect_s, reported_by=self.node)
        return first

    def restart_snapshot(self) -> Snapshot | None:
        """The leader picks the restart's snapshot of the attempt that just failed: every node verifies a share of
        the durable one; with the memory tier, the newest memory step every node holds wins when it is newer."""
        self.verify_for = self.attempt
        if self.memory.path is None:
            return super().restart_snapshot()
        self.source.refuse_poisoned(self.attempt_events("snapshot_quarantined"))
        durable = self.newest_snapshot()
        own, replicas = self.memory_holdings()
        floor = durable.step if durable is not None else -1
        self.memory_fetch = {}
        if self.resumed_from_memory and self.attempt_events("restore_failed"):
            return self.memory.use_step(None, "the last memory restore did not load on every node (its ranks were "
                                        "placed on other nodes? see --local-addr, or a replica failed its digests "
                                        "on the way): durable", self.event, self.say, durable,
                                        durable_told=self.source.remote is not None)
        best, fetch = newest_in_memory(own, replicas, floor)
        without = sorted(node for node, steps in own.items() if best is None and not any(s > floor for s in steps))
        from_peers = "".join(f", node {n} from node {p['from']}'s replica" for n, p in sorted(fetch.items()))
        why = (f"memory step {best} is held by every node ({len(own)}{from_peers}) and newer than the durable "
               f"step {floor}" if best is not None else
               f"no memory step newer than the durable step {floor} is held by every node"
               + (f" (none on node(s) {', '.join(map(str, without))})" if without else ""))
        self.memory_fetch = fetch
        return self.memory.use_step(best, why, self.event, self.say, durable, fetch.get(self.node),
                                    durable_told=self.source.remote is not None)  # a store's choice is an event

    def memory_holdings(self) -> tuple[dict[int, list[int]], dict[int, dict[int, dict[int, int]]]]:
        """The usable memory steps of every node of the attempt, and the replicas each holds of the others'
        ({holder: {node: {step: bytes}}}): this node's own, the others' from their teardown acknowledgements
        (a node that did not acknowledge, a lost one, holds none)."""
        own = {self.node: self.memory.usable_steps(self.ckpt_dir, self.run_id)}
        replicas = {self.node: self.memory.replica_steps(self.ckpt_dir, self.run_id)}
        others = [n for n in self.active if n != self.node]
        try:
            acks = self.job.teardown_acks(self.attempt, others)
        except StoreUnreachable:
            acks = {}
        for node in others:
            ack = acks.get(node) or {}
            own[node] = [int(s) for s in ack.get("memory_steps") or []]
            replicas[node] = {int(of): {int(step): int(size) for step, size in steps.items()}
                              for of, steps in (ack.get("replica_steps") or {}).items()}
        return own, replicas

    def newest_snapshot(self) -> Snapshot | None:
        """A restart's snapshot is verified by every node, a share each (the leader names it); else here alone."""
        attempt, self.verify_for = self.verify_for, None
        if attempt is None or not self.settings.leader or self.spec.store_url:  # a store: its own listing
            return super().newest_snapshot()
        return choose(self.job, attempt, self.ckpt_dir, self.active, self.node, self.say)

    def stop_file_present(self) -> bool:
        return super().stop_file_present() or self.remote_stop is not None

    # --- acting ---

    def request_stop(self) -> None:
        super().request_stop()
        try:
            self.job.request_stop(self.node, "stop")
        except StoreUnreachable:
            pass

    def abandon(self) -> None:
        """The leader is gone: this node's ranks have no peers left to save with (a stop's save would wait on
        a collective forever), so they get the failed attempt's short grace, not the stop grace."""
        if self.process is not None and self.process.exit_code() is None:
            self.teardown(failed=True)
        self.close()

    def close(self) -> None:
        self.alarm.close()
        super().close()

    def teardown(self, failed: bool = False) -> float:
        """This node's tree only: the sweep matches (run id, node), not other nodes' ranks on a shared host."""
        process = self._process()
        labels = {str(self.node)} | ({standby_label(self.settings.spare)} if self.settings.spare is not None else set())
        seconds = process.teardown(self.spec.grace_period, self.run_id, failed, node=labels,
                                   spare=self.standby.waiting_pids())
        self._link_rank_logs()
        self._stop_rank_output()
        return seconds

    def event(self, name: str, **fields: Any) -> None:
        """Every event names its node; a failure is written by the node that saw it first (one per incident);
        the run's own events are the leader's."""
        if name == "failure":
            first = self._post_failure(fields)
            if first is not None and first.get("node") != self.node:
                return
        if name in RUN_EVENTS and not self.settings.leader:
            return
        writer = 0 if self.settings.leader else self.node  # one writer per shared file: the others' are node-local
        records.log_event(self.paths.root, name, writer_node=writer, **{"node": self.node, **fields})  # a node in fields: the subject

    def _post_failure(self, fields: dict[str, Any]) -> dict[str, Any] | None:
        return post_failure(self.job, self.attempt, self.node, fields)


def post_failure(job: JobStore, attempt: int, node: int, fields: dict[str, Any]) -> dict[str, Any] | None:
    """Report this node's failure of ``attempt`` to the job (how the rank died too, so that every node can
    name it); returns the job's first one, the root cause (None when the store is unreachable)."""
    ranks = fields.get("stale_ranks") or ([fields["rank"]] if fields.get("rank") is not None else [])
    how = {k: fields.get(k) for k in ("signal", "exit_code") if fields.get(k) is not None}
    if fields.get("exception"):
        how["exception"] = str(fields["exception"])[:EXCEPTION_CHARS]
    try:
        return job.report_failure(attempt, node, ranks, str(fields.get("cause")),
                                  yield_s=PEER_ERROR_WAIT_S if peer_error(fields) else 0.0,
                                  rank=fields.get("rank"), step=fields.get("step"), detected_at=fields.get("detected_at"),
                                  detect_s=fields.get("detect_s"), **how)
    except StoreUnreachable:
        return None


EXCEPTION_CHARS = 500  # of a rank's exception, in the job's store (the event has it all)
PEER_ERROR_WAIT_S = 5.0  # how long a node that saw only a peer's connection error waits for the real root cause
PEER_ERRORS = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused")


def peer_error(failure: dict[str, Any]) -> bool:
    """A crash whose only fact is a collective's connection error: collateral of a rank that died elsewhere
    (no signal of its own). Such a node yields to one that saw a signal or another exception."""
    text = str(failure.get("exception") or "").lower()
    return failure.get("cause") == "crash" and not failure.get("signal") and any(p in text for p in PEER_ERRORS)
