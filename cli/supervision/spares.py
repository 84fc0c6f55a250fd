"""Hot spares: launchers that wait in the job's store to take a lost node's place at once.

``ckptrun launch --spare [the job's flags]`` connects to the leader's store as any node does (the same
checkpoint-token check), joins as spare *s* (``spare/<s>`` in the store: no node rank, no ranks, no torchrun)
and beats. When a node is lost, the leader promotes the first live spare to that node rank for the next
attempt (:meth:`SpareBench.promote`, from :meth:`~ckptrun.cli.supervision.node_agent.NodeJob.gather`):
no ``--node-join-timeout`` wait for the lost launcher to come back, the same world size, no reshard. The
spare's launcher then becomes node *k*: it takes node *k*'s place in the store (a higher incarnation) and
runs node *k*'s supervision loop from the next attempt, with its own ``--memory-dir`` and ``--local-addr``;
with the memory tier its ranks fetch node *k*'s shards from a replica on another node, else the restart is
durable. A relaunched launcher of the lost node rank that finds its rank held by a promoted spare joins
as a spare in turn (:func:`held_by_spare`). A spare is live while its beat changes on the leader's clock
(no clock agreement between hosts, as for nodes); ``RUN_DIR/spares/spare-<s>.json`` names each waiting
spare for ``ckptrun status``.

While it waits, a spare keeps a warm standby agent (:mod:`~ckptrun.cli.supervision.standby`, past its
imports of torchrun and the runtime), so that its first attempt as node *k* starts as a warm restart
does. The standby is started before the spare has a node rank: its environment (which the ranks it forks
show in ``/proc``) names the node ``spare-<s>`` (:func:`standby_label`), a label the node's teardown
sweeps too. What a spare does not do: take part in an elastic shrink (a spare only ever restores a lost
node's rank).
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable

from ckptrun.cli.supervision.job_store import LEADER_LOST_S, JobStore, NodeWatch, StoreUnreachable

SPARES_DIR = "spares"  # in the run dir: one holder file per waiting spare
SPARE_JOIN_S = 60.0  # how long the leader waits for a promoted spare to take its node, before waiting for a rejoin
POLL_S = 0.5


def holder_file(run_dir: Path, spare: int) -> Path:
    return run_dir / SPARES_DIR / f"spare-{spare}.json"


def listed(run_dir: Path) -> list[dict[str, Any]]:
    """The spares waiting for this run, from their holder files (``ckptrun status``)."""
    found = []
    for path in sorted((run_dir / SPARES_DIR).glob("spare-*.json")):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return found


class SpareBench:
    """The leader's view of the spares: which are live, and promoting one to a lost node's rank."""

    def __init__(self, job: JobStore, timeout_s: float, event: Callable[..., None] = lambda *_, **__: None) -> None:
        self.job, self.watch, self.event = job, NodeWatch(timeout_s), event
        self.started = time.time()
        self.known: set[int] = set()

    def observe(self) -> dict[int, dict[str, Any]]:
        """Every spare and its beat, observed on the leader's clock (call it every second or so: a beat that
        stops changing is stale after the node timeout). A spare seen the first time is a ``spare_joined`` event:
        what ``estimate-rto`` reads to model a lost node's replacement."""
        spares = self.job.spares()
        self.watch.observe(self.job.spare_beats(spares), time.time())
        for spare in sorted(set(spares) - self.known):
            self.known.add(spare)
            self.event("spare_joined", spare=spare, host=spares[spare].get("host"), pid=spares[spare].get("pid"))
        return spares

    def live(self) -> list[int]:
        spares = self.observe()
        waiting = [s for s, facts in spares.items() if not facts.get("promoted")]
        stale = set(self.watch.stale(waiting, time.time(), since=self.started))
        return [s for s in waiting if s not in stale and s in self.watch.seen]

    def promote(self, node: int, attempt: int, before: int, event: Callable[..., None],
                say: Callable[[str], None]) -> int | None:
        """Give node rank ``node`` to the first live spare and wait for it to take it (node ``node``'s
        incarnation above ``before``); the new incarnation, or None (no live spare, or it did not come)."""
        for spare in self.live():
            won = self.job.promote_spare(spare, node, attempt)
            if won.get("node") != node or won.get("attempt") != attempt:
                continue  # promoted before (another incident): not this one's to take
            started = time.monotonic()
            facts = self.job.spares().get(spare, {})
            say(f"node {node} is lost: spare {spare} ({facts.get('host')}) takes its place")
            deadline = started + SPARE_JOIN_S
            while time.monotonic() < deadline:
                record = self.job.node(node) or {}
                if int(record.get("incarnation", 0)) > before and record.get("spare") == spare:
                    event("spare_promoted", spare=spare, node=node, host=facts.get("host"), pid=facts.get("pid"),
                          attempt=attempt + 1, joined_s=round(time.monotonic() - started, 3))
                    return int(record["incarnation"])
                time.sleep(POLL_S / 5)
            say(f"spare {spare} did not take node {node} within {SPARE_JOIN_S:g}s")
        return None


def standby_label(spare: int) -> str:
    """The node label a spare's standby (and the ranks it forks) carries: the sweep's match for them."""
    return f"spare-{spare}"


def held_by_spare(job: JobStore, node: int) -> int | None:
    """The spare that holds node rank ``node`` now (it was promoted to it), or None."""
    record = job.node(node) or {}
    spare = record.get("spare")
    return int(spare) if spare is not None else None


def wait_for_promotion(job: JobStore, run_dir: Path, say: Callable[[str], None],
                       joined: Callable[[int], None] = lambda _: None) -> tuple[int, int | None, dict[str, Any] | None]:
    """Join as a spare (``joined(spare)`` then: start what waits warm) and beat until the leader promotes this
    launcher (returns (spare, node, None)) or the job ends ((spare, None, verdict); a verdict of None: the
    leader is gone)."""
    host = socket.gethostname()
    spare = job.join_spare(host=host)
    joined(spare)
    holder = holder_file(run_dir, spare)
    holder.parent.mkdir(parents=True, exist_ok=True)
    holder.write_text(json.dumps({"spare": spare, "pid": os.getpid(), "host": host, "time": time.time()}))
    say(f"spare {spare}: waiting to take a lost node's place (the job's store at {job.run_id})")
    unreachable: float | None = None
    try:
        while True:
            try:
                job.beat_spare(spare, pid=os.getpid())
                promoted, verdict = job.promotion(spare), job.verdict()
                unreachable = None
            except StoreUnreachable:
                unreachable = unreachable or time.monotonic()
                if time.monotonic() - unreachable >= LEADER_LOST_S:
                    return spare, None, None
                time.sleep(POLL_S)
                continue
            if promoted is not None:
                return spare, int(promoted["node"]), None
            if verdict is not None:
                return spare, None, verdict
            time.sleep(POLL_S)
    finally:
        holder.unlink(missing_ok=True)
