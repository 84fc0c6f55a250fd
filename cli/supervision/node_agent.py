"""One node's part in a multi-node job's decisions: the :class:`~ckptrun.cli.supervision.job.Job` of many nodes.

Each node runs the one supervision loop
(:class:`~ckptrun.cli.supervision.supervisor.Supervisor`) and watches its own
attempt exactly as on one node (crash, hang with stack dumps, stop, first
step), through a :class:`~ckptrun.cli.supervision.node_world.NodeWorld`.
Between attempts the roles differ, and :class:`NodeJob` is where: every
node acknowledges its teardown in the store. The leader's loop (node rank 0)
alone holds the restart budget, back-off, no-progress rule and RTO ledger;
its :class:`NodeJob` takes the attempt's *first*
failure from the store (one budget unit per incident, whichever node saw
it), waits for every node's teardown (and, after a lost node, for its
relaunched launcher to join, up to ``--node-join-timeout``), picks and
verifies the snapshot and publishes the next attempt; the other nodes
relaunch with that attempt number and snapshot, or end with the leader's
verdict. A client that loses the leader tears down and exits
:data:`EXIT_REQUEUE` (resumable: the scheduler restarts the job).
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

from ckptrun.cli.errors import EXIT_NO, EXIT_REQUEUE
from ckptrun.cli.supervision.job import Next
from ckptrun.cli.supervision.job_store import JobStore, StoreUnreachable
from ckptrun.cli.supervision.node_verify import answer, early_share
from ckptrun.cli.supervision.node_world import LEADER_LOST_S, SYNC_EVERY_S, LeaderLost, NodeWorld, post_failure
from ckptrun.cli.supervision.observation import AttemptWatch, Outcome, Snapshot, StopControl
from ckptrun.cli.supervision.policy import GiveUp, Timeouts


def describe_snapshot(snapshot: Snapshot | None) -> dict[str, Any] | None:
    """What the store carries about the chosen snapshot: path, step and the manifest's digest."""
    if snapshot is None:
        return None
    manifest = Path(snapshot.path) / "manifest.json"
    digest = hashlib.sha256(manifest.read_bytes()).hexdigest() if manifest.exists() else None
    return {"path": str(snapshot.path), "step": snapshot.step, "digest": digest, "verify_s": snapshot.verify_s}


def is_next(record: dict[str, Any] | None, after_attempt: int, node: int) -> bool:
    """The leader's attempt record is one ``node`` runs next: numbered above ``after_attempt``, listing it."""
    return record is not None and int(record["attempt"]) > after_attempt and node in record["nodes"]


class NodeJob:
    """One node's part in the job's decisions; ``world.settings.leader`` says whether it decides for the job."""

    def __init__(self, world: NodeWorld, timeouts: Timeouts, stop: StopControl, join_timeout: float) -> None:
        self.world, self.timeouts, self.stop, self.join_timeout = world, timeouts, stop, join_timeout
        self.incarnations: dict[int, int] = {}
        self.first_attempt, self.resume = 1, None  # the loop's first attempt and its snapshot (set by start)
        self.waited = 0.0  # the leader's last gather: how long it waited for lost nodes (the RTO ledger)
        self.lost_nodes: list[int] = []
        self.told: int | None = None  # a follower: the leader's words read (the next one it waits for is after)

    @property
    def job(self) -> JobStore:
        return self.world.job

    @property
    def leader(self) -> bool:
        return self.world.settings.leader

    leads = leader

    def root_cause(self, watch: AttemptWatch) -> dict[str, Any] | None:
        """Post this node's failure (a peer's connection error first waits for the node where the rank died);
        the job's first one, when another node's."""
        first = post_failure(self.job, watch.attempt, self.world.node, watch.failure or {})
        return first if first is not None and first.get("node") != self.world.node else None

    def torn_down(self, watch: AttemptWatch) -> None:
        """Tell the leader this node's ranks are gone, (memory tier) which of its memory steps are usable, and
        its verdict on its share of the newest snapshot (:func:`~ckptrun.cli.supervision.node_verify.early_share`)."""
        if self.leader:
            self._call(self.job.ack_teardown, watch.attempt, self.world.node, teardown_s=watch.teardown_s)
            return
        memory = self.world.memory.usable_steps(self.world.ckpt_dir, self.world.run_id)
        replicas = self.world.memory.replica_steps(self.world.ckpt_dir, self.world.run_id)
        self._call(self.job.ack_teardown, watch.attempt, self.world.node, teardown_s=watch.teardown_s,
                   memory_steps=memory, replica_steps=replicas, verified=self._early_verdict(watch.attempt))

    def _early_verdict(self, attempt: int) -> dict[str, Any] | None:
        """This node's share of the snapshot the leader will most likely verify next (not with an object store:
        the leader reads that one's listing alone)."""
        if getattr(self.world.spec, "store_url", None):
            return None
        try:
            return self._call(early_share, self.job, attempt, self.world.ckpt_dir, self.world.node, self.world.active)
        except (OSError, ValueError):  # the checkpoint dir (or its lineage) unreadable here: a round decides
            return None

    def ended(self, outcome: Outcome, restarts: int) -> None:
        if self.leader:
            self._publish_end(outcome, restarts)
        else:
            self._ack_end(outcome)

    # --- the first attempt -----------------------------------------------------------------

    def start(self, attempt: int, resume: Snapshot | None) -> Next | Outcome:
        self.first_attempt, self.resume = attempt, resume
        try:  # the attempt running before this node joins is not this node's: wait for a higher number
            current = self.job.attempt()
        except StoreUnreachable as exc:
            raise LeaderLost(str(exc)) from None
        spare = self.world.settings.spare  # a promoted spare takes the node's place: the leader waits for this
        self._call(self.job.join, self.world.node, **({"spare": spare} if spare is not None else {}))
        if self.leader:
            missing = self._wait_for_nodes(self.world.nodes, self.timeouts.startup)
            if missing:
                return self._not_joined(missing)
            self._call(self.job.start_attempt, self.first_attempt, describe_snapshot(self.resume), self.world.nodes)
            return self.first_attempt, self.resume
        return self._next_attempt(after_attempt=int(current["attempt"]) if current else 0)

    # --- the leader between attempts --------------------------------------------------------

    def gather(self, watch: AttemptWatch) -> GiveUp | None:
        """The attempt's first failure (whichever node saw it: one budget unit per incident), every node's
        teardown, and each lost node waited for (or left out, elastic); a verdict when one stays lost."""
        first = self.job.failure(watch.attempt) or {}
        if first.get("node") not in (None, self.world.node):
            watch.failure = {**(watch.failure or {}), **{k: first.get(k) for k in ("cause", "rank", "step", "detect_s")},
                             "node": first.get("node")}
        waited = time.monotonic()  # a lost node's silence is waited out here: part of the RTO (node_join_s)
        self._wait_for_acks(watch.attempt)
        lost_nodes = self._lost_nodes(first)
        for lost in lost_nodes:
            if self._take_spare(watch.attempt, lost):
                continue
            if not self._wait_for_rejoin(lost, watch.attempt) and not self._shrink(watch, lost):
                reason = f"node {lost} was lost and no launcher of node rank {lost} joined within {self.join_timeout:g}s"
                return GiveUp(EXIT_NO, reason, "relaunch `ckptrun resume --latest` on every node")
        self._grow(watch)
        self.waited, self.lost_nodes = time.monotonic() - waited, lost_nodes
        return None

    def restarting(self, watch: AttemptWatch, snapshot: Snapshot | None, pending: dict[str, Any] | None) -> None:
        """Publish the next attempt: its number, the snapshot every node resumes from, the nodes that run it."""
        if pending is not None:  # the RTO ledger: the wait for every node's teardown (a lost one's silence to
            # last the node timeout) and for a lost node's replacement; who verified
            pending.update(node_join_s=self.waited, nodes=list(self.world.active), lost_nodes=self.lost_nodes)
        described = describe_snapshot(snapshot)
        if described is not None and self.world.memory.holds(snapshot.path):  # type: ignore[union-attr]
            described["tier"] = "memory"  # every node resumes from its own copy of that step, or fetches it
            described["fetch"] = self.world.memory_fetch  # ... from another node's replica
        self.job.start_attempt(watch.attempt + 1, described, self.world.active)

    def _wait_for_acks(self, attempt: int) -> None:
        """Every node has torn attempt ``attempt`` down (a silent or relaunched node is not waited for): the
        last ack's key wakes the wait, which ends every second to look for silent nodes."""
        deadline, judged, gone = time.monotonic() + self.timeouts.grace + self.world.watch.timeout_s, float("-inf"), set()
        while time.monotonic() < deadline:
            if time.monotonic() - judged >= SYNC_EVERY_S:  # every heartbeat and node record: once a second
                gone, judged = set(self._silent()) | set(self._relaunched()), time.monotonic()
            acks = self.job.teardown_acked(attempt, self.world.active)
            waiting = set(self.world.active) - acks - gone - {self.world.node}
            if not waiting:
                return
            self.job.wait_for_acks(attempt, sorted(waiting), min(max(self.timeouts.poll, SYNC_EVERY_S),
                                                                   deadline - time.monotonic()))

    def _others(self) -> list[int]:
        return [n for n in self.world.active if n != self.world.node]

    def _shrink(self, watch: AttemptWatch, lost: int) -> bool:
        """Elastic (``--nnodes MIN:MAX`` with ``--allow-reshard``): go on without ``lost`` if MIN nodes remain."""
        left = [n for n in self.world.active if n != lost]
        if len(left) < self.world.settings.min_nodes or not self.world.spec.allow_reshard:
            return False
        self.world.active = left
        self.world.event("nodes_changed", attempt=watch.attempt + 1, lost=[lost], nodes=left,
                         reason=f"node {lost} did not rejoin within {self.join_timeout:g}s: continuing resharded")
        self.world.say(f"node {lost} did not come back: continuing on nodes {left} from the newest snapshot, resharded")
        return True

    def _grow(self, watch: AttemptWatch) -> None:
        """A dropped node whose launcher joined again takes part from the next attempt on."""
        dropped = [n for n in self.world.nodes if n not in self.world.active]
        records = self.job.nodes(dropped) if dropped else {}
        back = [n for n in dropped if int(records.get(n, {}).get("incarnation", 0)) > self.incarnations.get(n, 1)]
        if back:
            for node in back:
                self.incarnations[node] = int(records[node]["incarnation"])
            self.world.active = sorted({*self.world.active, *back})
            self.world.event("nodes_changed", attempt=watch.attempt + 1, joined=back, nodes=self.world.active,
                             reason="a dropped node's launcher joined again")

    def _silent(self) -> list[int]:
        """Nodes whose supervisor stopped beating (the leader's own clock judges)."""
        self.world.watch.observe(self.job.heartbeats(self._others()), time.time())
        return self.world.watch.stale(self._others(), time.time(), since=time.time())

    def _relaunched(self) -> list[int]:
        """Nodes whose launcher was replaced by a new one (it joined again: a higher incarnation)."""
        records = self.job.nodes(self._others())  # one batched read, not one per node
        return [n for n in self._others()
                if int(records.get(n, {}).get("incarnation", 0)) > self.incarnations.get(n, 1)]

    def _lost_nodes(self, first: dict[str, Any]) -> list[int]:
        """Nodes whose launcher died in this attempt, whatever was reported first (a lost node's peers
        usually crash in a collective before its heartbeat goes stale)."""
        lost = set(self._silent()) | set(self._relaunched())
        if first.get("cause") == "node lost":
            lost.add(int(first["node"]))
        return sorted(lost)

    def _take_spare(self, attempt: int, node: int) -> bool:
        """A live spare takes lost node ``node``'s rank for the attempt after ``attempt`` (:mod:`spares`): no
        join wait."""
        if self.world.spares is None:
            return False
        taken = self.world.spares.promote(node, attempt, self.incarnations.get(node, 1), self.world.event,
                                          self.world.say)
        if taken is None:
            return False
        self.incarnations[node] = taken
        return True

    def _wait_for_rejoin(self, node: int, attempt: int | None = None) -> bool:
        """A new launcher of ``node`` joined (a higher incarnation), its supervisor beats again (the same
        incarnation: it was only quiet, e.g. a network blip), or a spare that came meanwhile took its place."""
        self.world.say(f"node {node} is lost: waiting up to {self.join_timeout:g}s for its launcher to join again")
        before = self.incarnations.get(node, 1)
        self.world.event("node_wait", node=node, join_timeout_s=self.join_timeout)
        started = time.time()
        beat = (self.job.heartbeats([node]).get(node) or {}).get("time")
        deadline = time.monotonic() + self.join_timeout
        while time.monotonic() < deadline:
            record = self.job.node(node) or {}
            incarnation = int(record.get("incarnation", 0))
            if incarnation > before or (self.job.heartbeats([node]).get(node) or {}).get("time") != beat:
                self.incarnations[node] = max(incarnation, before)
                self.world.event("node_joined", node=node, waited_s=time.time() - started,
                                 relaunched=incarnation > before)
                return True
            if attempt is not None and self.world.spares is not None and self.world.spares.live() \
                    and self._take_spare(attempt, node):
                return True
            time.sleep(self.timeouts.poll)
        return False

    def _wait_for_nodes(self, nodes: list[int], timeout: float) -> list[int]:
        """Wait for every node's launcher to join; the nodes still missing after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            records = self.job.nodes(nodes)
            missing = [n for n in nodes if n != self.world.node and n not in records]
            if not missing:
                for n in nodes:
                    self.incarnations[n] = int(records.get(n, {}).get("incarnation", 1))
                return []
            if time.monotonic() >= deadline:
                return missing
            self.job.wait_for_joins(missing, min(self.timeouts.poll, deadline - time.monotonic()))

    def _not_joined(self, missing: list[int]) -> Outcome:
        """Start-up ends without every node: the leader's verdict (published by :meth:`ended`) names them."""
        message = f"node(s) {missing} did not join within {self.timeouts.startup:g}s (--startup-timeout): nothing ran"
        if self.resume is not None:  # a resume: its snapshot is still there
            code, hint = EXIT_REQUEUE, ("start `ckptrun resume --latest` on every node (the same --rdzv-endpoint), "
                                        "or let the scheduler requeue the job")
        else:
            code, hint = EXIT_NO, ("start `ckptrun launch` on every node with the same --rdzv-endpoint and a new "
                                   "--name (this one holds the run that did not start)")
        self.world.say(message)
        self.world.event("gave_up", attempt=self.first_attempt, exit_code=code, reason=message, missing_nodes=missing,
                         restarts=0)
        return Outcome(code, message, hint, restarts=0)

    # --- a client between attempts ------------------------------------------------------------

    def follow(self, attempt: int) -> Next | Outcome:
        return self._next_attempt(after_attempt=attempt)

    def _next_attempt(self, after_attempt: int) -> Next | Outcome:
        """Wait for the leader's word: an attempt numbered above ``after_attempt`` that lists this node (its
        number, never the leader's clock, says it is new), or how the job ends. Each word holds everything the
        leader said (attempt, verify round, verdict): read the latest once (after the first time: the one after
        the word that started this node's attempt), then wait on the next ``news/<n>`` key and read it when it
        wakes the wait (one request each)."""
        unreachable, verified, told, fresh = None, set(), self.told, self.told is None  # read up to self.told
        beaten = time.monotonic()  # its poll beat less than SYNC_EVERY_S ago
        while True:
            if fresh:  # a word not read yet (or the store was unreachable)
                try:
                    told = self.job.news() if told is None else told
                    word = self.job.word(told) if told else {}
                    unreachable, fresh = None, False
                except StoreUnreachable as exc:
                    unreachable = unreachable or time.monotonic()
                    if time.monotonic() - unreachable >= LEADER_LOST_S:
                        raise LeaderLost(str(exc)) from None
                    time.sleep(self.timeouts.poll)
                    continue
                record, verdict = word.get("attempt"), word.get("verdict")
                if record is not None:
                    self._call(answer, self.job, word.get("verify"), int(record["attempt"]), self.world.node, verified)
                self.told = told
                if verdict is not None:
                    return Outcome(int(verdict["code"]), str(verdict["message"]), verdict.get("hint"),
                                   restarts=int(verdict.get("restarts", 0)))
                if is_next(record, after_attempt, self.world.node):
                    return self._run_next(record)  # type: ignore[arg-type]
            if time.monotonic() - beaten >= SYNC_EVERY_S:  # the leader judges silence over >= 5 s
                beaten = time.monotonic()
                self._call(self.job.beat, self.world.node, attempt=after_attempt, state="waiting")
            if self.stop.reason(time.time(), self.world.stop_file_present()):
                self._call(self.job.request_stop, self.world.node, "stop while waiting for the leader")
            woke = self._call(self.job.wait_for_news, told, max(self.timeouts.poll, SYNC_EVERY_S))  # its key ends it
            if woke is None:  # unreachable: the next read counts how long
                fresh = True
                time.sleep(self.timeouts.poll)
            elif woke:
                told, fresh = told + 1, True  # type: ignore[operator]

    def _run_next(self, record: dict[str, Any]) -> Next:
        """The leader's next attempt for this node: its number, and the snapshot it resumes from, as this node
        reaches it (its memory copy or a replica's, its node cache, or the durable one)."""
        snap = record.get("snapshot")
        resume = Snapshot(Path(snap["path"]), int(snap["step"])) if snap else None
        self.world.memory_fetch = {int(n): peer for n, peer in ((snap or {}).get("fetch") or {}).items()}
        if snap and snap.get("tier") == "memory":
            peer = self.world.memory_fetch.get(self.world.node)
            held = f"fetched from node {peer['from']}'s replica" if peer else "held by every node"
            resume = self.world.memory.use_step(int(snap["step"]), f"the leader chose memory step {snap['step']}, "
                                                + held, self.world.event, self.world.say, peer=peer)
        else:  # durable; with --local-cache on many nodes, this node's own copy: its files from its
            # cache, the others' downloaded (its own restore_source)
            own = bool(snap) and self.world.spec.node_cache_dir is not None and self.world.source.remote is not None
            if int(record["attempt"]) > 1 and self.world.memory.path is not None:
                self.world.memory.use_step(None, "the leader chose the durable snapshot", self.world.event,
                                           self.world.say, resume, durable_told=own)
            if own:
                resume = self.world.source.own_copy(str(snap["digest"]), int(snap["step"])) or resume
        self.world.active = list(record["nodes"])
        return int(record["attempt"]), resume

    # --- endings --------------------------------------------------------------------------------

    def _publish_end(self, outcome: Outcome, restarts: int) -> None:
        """Say how the job ended, then keep the store up until every node has read it (bounded)."""
        action = {0: "done", 3: "stopped"}.get(outcome.code, "gave_up")
        self._call(self.job.set_verdict, action, outcome.code, outcome.message, hint=outcome.hint,
                   restarts=restarts)
        deadline = time.monotonic() + self.timeouts.grace
        waiting = [n for n in self.world.nodes if n not in self.world.active  # dropped, then joined again
                   and int((self._call(self.job.node, n) or {}).get("incarnation", 0)) > self.incarnations.get(n, 1)]
        others = [n for n in {*self.world.active, *waiting} if n != self.world.node]
        while time.monotonic() < deadline and others:
            ended = self._call(self.job.teardown_acks, "end", others) or {}
            if set(others) <= set(ended):
                return
            time.sleep(self.timeouts.poll)

    def _ack_end(self, outcome: Outcome) -> None:
        self._call(self.job.ack_teardown, "end", self.world.node, code=outcome.code)

    def lost(self, detail: str, restarts: int) -> Outcome:
        self.world.abandon()
        self.world.event("leader_lost", detail=detail)
        self.world.say(f"lost the job's leader (node 0): {detail}; this node's ranks are down")
        return Outcome(EXIT_REQUEUE, "lost the job's leader (node 0's launcher or its host is gone)",
                       "the job is resumable: let the scheduler requeue it, or run `ckptrun resume --latest` "
                       "on every node", restarts=restarts)

    def _call(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except StoreUnreachable:
            return None
