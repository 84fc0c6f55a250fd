"""Memory replicas on other nodes: each node's memory snapshot copied to R other nodes and verified on receipt.

A node's memory snapshot (:mod:`memory_tier`) dies with the node. So that a lost node costs no durable read,
each node's first rank (its *lead*) sends every memory snapshot it published to the leads of the next R
nodes of a ring (node k to k+1 … k+R, modulo the nodes; with ``--node-group`` the ring alternates the groups,
so that replicas leave their failure domain: :class:`Ring`), in the background, over a gloo group of the leads:
the manifest first, then each listed file in pieces of :data:`PIECE` bytes, at most :data:`WINDOW` in flight,
read from the published files (no copy) and received into two piece-sized buffers: each piece is hashed
and written to the replica's file while the next arrives in the other (plain writes: filling a fresh ``mmap``
of a tmpfs file faulted its pages in one by one, more CPU than a socket copy's whole receive, and a full tmpfs
was a SIGBUS). The receiver hashes every piece as it arrives, at the manifest's chunk boundaries (the digests
of the sender's manifest: a replica is the sender's snapshot, byte for byte), and publishes the replica
atomically as ``<memory dir>/replicas/node<k>/step-N`` only when every chunk matched; it is counted (by the supervisor,
:mod:`ckptrun.cli.supervision.memory_tier`) only then. A replica that does not match is deleted on receipt,
named in a ``replica_rejected`` event, and the sender told (an ack per snapshot).

The same transport serves the restore after a lost node: the leader names, in contract C1
(``RunEnv.memory_fetch``), the nodes that have no copy of the chosen step and the node holding a replica of
it; before anything loads, each such node's lead receives its shards from that node's lead into its own
memory directory, verifying every chunk as it arrives, and the ranks then load as from their own memory.
A replica that fails on the way is dropped by its holder, and the restore fails on every rank alike: the
next restart is durable (one extra restart at most).

Why the ranks and not the supervisors: the bytes are in the ranks' process group already, gloo moves them at
the loopback's or the network's speed, and the transport needs no port, credentials or protocol of ours.
Threads: one sender (it takes the newest snapshot offered; one still waiting when a newer comes is skipped)
and one receiver per source node, each blocking in gloo with the GIL released, never in the training step,
at the background writer's lowered CPU and I/O priority. The restore's fetch runs at normal priority: it is
what the restart waits for.
"""

from __future__ import annotations

import datetime
import json
import mmap
import os
import queue
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from ckptrun.runtime import hashing
from ckptrun.runtime.checkpoint.saver import lower_priority
from ckptrun.runtime.manifest import MANIFEST_NAME, Manifest
from ckptrun.runtime.storage import store

PIECE = 16 * 2**20  # bytes per message: large enough for gloo's rate, small enough to hash as the next arrives
WINDOW = 4  # pieces a sender keeps in flight
TAG_REPLICA, TAG_FETCH, TAG_ACK = 41, 42, 43
END = -1  # a header length that says "no more snapshots from me" (a clean end of training)
GROUP_TIMEOUT = datetime.timedelta(days=7)  # a receiver waits for the next memory save, however far apart


@dataclass(frozen=True)
class Ring:
    """Who replicates to whom: node k's snapshots go to the next R nodes of a ring (without failure domains,
    k+1 … k+R modulo the nodes). With ``--node-group`` (each node's failure domain: a rack, a switch) the
    ring runs over the nodes interleaved by group (one of each group in turn), so that a node's next R nodes
    are in other groups wherever the groups' sizes allow, and every node still holds R replicas."""

    leads: tuple[int, ...]  # the job rank of each node's lead, by node
    replicas: int
    order: tuple[int, ...] = ()  # the ring's nodes in ring order (empty: 0 … N-1)

    @classmethod
    def of(cls, placement: list[int], replicas: int, groups: list[str | None] | None = None) -> "Ring":
        """From every rank's node (:func:`collectives.node_of_each_rank`): the first rank of each node leads it;
        ``groups``: every rank's ``--node-group`` (None: a domain of its own)."""
        nodes = sorted(set(placement))
        leads = tuple(placement.index(node) for node in nodes)
        order = interleaved([groups[lead] for lead in leads]) if groups and any(groups) else ()
        return cls(leads, max(0, min(replicas, len(nodes) - 1)), order)

    def _ring(self) -> tuple[int, ...]:
        return self.order or tuple(range(len(self.leads)))

    def targets(self, node: int) -> list[int]:
        ring = self._ring()
        at = ring.index(node)
        return [ring[(at + i) % len(ring)] for i in range(1, self.replicas + 1)]

    def sources(self, node: int) -> list[int]:
        ring = self._ring()
        at = ring.index(node)
        return [ring[(at - i) % len(ring)] for i in range(1, self.replicas + 1)]


def interleaved(groups: list[str | None]) -> tuple[int, ...]:
    """The nodes (indexes of ``groups``) one of each group in turn, groups by name, nodes by index within one;
    a node without a group is a group of its own."""
    members: dict[str, list[int]] = {}
    for node, group in enumerate(groups):
        members.setdefault(group if group else f"\0{node:09d}", []).append(node)
    queues = [members[name] for name in sorted(members)]
    order: list[int] = []
    while any(queues):
        order.extend(q.pop(0) for q in queues if q)
    return tuple(order)


def leads_group(ring: Ring) -> Any:
    """A gloo group of the nodes' leads (every rank calls it at the same point, as any new group)."""
    return dist.new_group(list(ring.leads), backend="gloo", timeout=GROUP_TIMEOUT)


@dataclass
class Received:
    """What one receipt brought: the published replica (None when rejected), and what it cost."""

    step: int
    path: Path | None
    bytes: int
    seconds: float
    problem: str | None = None


def send_snapshot(snapshot: Path, dst: int, group: Any, tag: int) -> bool:
    """Send a published snapshot to job rank ``dst``: its manifest, then every listed file; True when the
    receiver verified every chunk of it."""
    text = (snapshot / MANIFEST_NAME).read_bytes()
    manifest = Manifest.model_validate_json(text)
    header = json.dumps({"step": manifest.step, "manifest": text.decode()}).encode()
    dist.send(torch.tensor([len(header)], dtype=torch.int64), dst=dst, group=group, tag=tag)
    dist.send(torch.frombuffer(bytearray(header), dtype=torch.uint8), dst=dst, group=group, tag=tag)
    for entry in manifest.files:
        if entry.size:
            _send_file(snapshot / entry.path, entry.size, dst, group, tag)
    ack = torch.zeros(1, dtype=torch.int64)
    dist.recv(ack, src=dst, group=group, tag=TAG_ACK)
    return bool(ack.item())


def _send_file(path: Path, size: int, dst: int, group: Any, tag: int) -> None:
    with open(path, "rb") as stream, mmap.mmap(stream.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
        data = torch.frombuffer(mapped, dtype=torch.uint8)  # the file's pages, sent as they are (copy-on-write map)
        works = []
        for offset in range(0, size, PIECE):
            works.append(dist.isend(data[offset:offset + PIECE], dst=dst, group=group, tag=tag))
            if len(works) > WINDOW:
                works.pop(0).wait()
        for work in works:
            work.wait()
        del data, works  # the map cannot close while a tensor views it


def send_end(dst: int, group: Any, tag: int) -> None:
    dist.send(torch.tensor([END], dtype=torch.int64), dst=dst, group=group, tag=tag)


def receive_snapshot(parent: Path, src: int, group: Any, tag: int) -> Received | None:
    """Receive one snapshot from job rank ``src`` into ``parent`` (None: the sender ended), each chunk hashed
    as it arrives; published as ``parent/step-N`` (replacing one of that step) only when every chunk matched."""
    length = torch.zeros(1, dtype=torch.int64)
    dist.recv(length, src=src, group=group, tag=tag)
    if int(length.item()) == END:
        return None
    header = torch.empty(int(length.item()), dtype=torch.uint8)
    dist.recv(header, src=src, group=group, tag=tag)
    fields = json.loads(bytes(header.numpy()))
    text, started = fields["manifest"], time.monotonic()
    manifest = Manifest.model_validate_json(text)
    temp = store.new_temp_dir(parent, manifest.step)
    problem, moved = None, 0
    try:
        for entry in manifest.files:
            target = temp / entry.path
            target.parent.mkdir(parents=True, exist_ok=True)
            bad = _receive_file(target, entry, src, group, tag)
            problem, moved = problem or bad, moved + entry.size
        (temp / MANIFEST_NAME).write_text(text)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    dist.send(torch.tensor([int(problem is None)], dtype=torch.int64), dst=src, group=group, tag=TAG_ACK)
    if problem is not None:
        shutil.rmtree(temp, ignore_errors=True)
        return Received(manifest.step, None, moved, time.monotonic() - started, problem)
    final = parent / store.snapshot_name(manifest.step)
    if final.exists():  # the same step saved again after a restart from an older one: the newer replaces it
        store.delete_snapshot(final)
    os.rename(temp, final)
    return Received(manifest.step, final, moved, time.monotonic() - started)


def _receive_file(target: Path, entry: Any, src: int, group: Any, tag: int) -> str | None:
    """Receive one file into ``target`` piece by piece, each piece hashed and written from its buffer while the
    next arrives in the other; what is wrong with it (the first chunk that does not match its digest), or None."""
    hasher = hashing.entry_hasher(entry)
    pieces = [(offset, min(PIECE, entry.size - offset)) for offset in range(0, entry.size, PIECE)]
    buffers = [torch.empty(min(PIECE, entry.size), dtype=torch.uint8) for _ in pieces[:2]]
    with open(target, "wb", buffering=0) as stream:
        work = dist.irecv(buffers[0][:pieces[0][1]], src=src, group=group, tag=tag) if pieces else None
        for index, (_, size) in enumerate(pieces):
            work.wait()
            if index + 1 < len(pieces):  # into the other buffer: this one's piece was hashed and written before
                following = buffers[(index + 1) % 2][:pieces[index + 1][1]]
                work = dist.irecv(following, src=src, group=group, tag=tag)
            view = memoryview(buffers[index % 2].numpy())[:size]
            hasher.update(view)  # the GIL is released while hashing and while writing
            while len(view):
                view = view[stream.write(view):]
    if hasher.hexdigest() == entry.digest:
        return None
    bad = hasher.bad_chunks() if hasattr(hasher, "bad_chunks") else []
    if bad:
        chunk = bad[0][0]
        return f"{entry.path}: bytes {chunk.offset}..{chunk.offset + chunk.length} do not match their digest"
    return f"{entry.path}: does not match its digest"


def keep_newest(directory: Path, keep: int) -> None:
    """Retention of one source node's replicas: the newest ``keep``; leftovers of interrupted receipts go."""
    store.clean_temp_dirs(directory)
    entries = sorted((e for e in store.list_entries(directory, include_abandoned=False) if e.kind == "published"),
                     key=lambda e: e.step)
    for entry in entries[:-max(1, keep)]:
        store.delete_snapshot(entry.path)


class Replicator:
    """One node lead's replication: a sender thread for this node's memory snapshots, a receiver per source."""

    def __init__(self, ring: Ring, group: Any, node: int, memory_dir: Path, keep: int,
                 event: Callable[..., None]) -> None:
        self.ring, self.group, self.node, self.memory_dir, self.keep, self.event = ring, group, node, memory_dir, keep, event
        self.offers: queue.Queue[Path | None] = queue.Queue()
        self.threads: list[threading.Thread] = []

    def start(self) -> None:
        """Begin at the first memory save (every lead at the same step: each receiver is there for its sender)."""
        if self.threads:
            return
        self.threads = [threading.Thread(target=self._send_loop, name="ckptrun-replica-send", daemon=True)]
        self.threads += [threading.Thread(target=self._receive_loop, args=(source,), daemon=True,
                                          name=f"ckptrun-replica-from-{source}") for source in self.ring.sources(self.node)]
        for thread in self.threads:
            thread.start()

    def offer(self, snapshot: Path) -> None:
        """A memory snapshot of this node was published: replicate it (on the sender thread)."""
        self.offers.put(snapshot)

    def _send_loop(self) -> None:
        lower_priority()  # background work: training keeps the cores it needs
        while True:
            snapshot = self.offers.get()
            while snapshot is not None and not self.offers.empty():  # a newer one came meanwhile: it replaces this
                snapshot = self.offers.get()
            if snapshot is None:
                for target in self.ring.targets(self.node):
                    send_end(self.ring.leads[target], self.group, TAG_REPLICA)
                return
            for target in self.ring.targets(self.node):
                try:
                    if snapshot.is_dir():
                        send_snapshot(snapshot, self.ring.leads[target], self.group, TAG_REPLICA)
                except Exception as exc:  # noqa: BLE001 - a peer gone (its attempt is failing): no more replicas
                    self.event("replica_send_failed", node=self.node, to_node=target, snapshot=str(snapshot),
                               error=f"{type(exc).__name__}: {exc}"[:300])
                    return

    def _receive_loop(self, source: int) -> None:
        lower_priority()
        directory = store.replica_dir(self.memory_dir, source)
        directory.mkdir(parents=True, exist_ok=True)
        while True:
            try:
                got = receive_snapshot(directory, self.ring.leads[source], self.group, TAG_REPLICA)
            except Exception:  # noqa: BLE001 - the sender is gone (its attempt is failing): the teardown follows
                store.clean_temp_dirs(directory)
                return
            if got is None:
                return
            if got.problem is not None:
                self.event("replica_rejected", node=self.node, from_node=source, step=got.step, reason=got.problem)
                continue
            self.event("replica_received", node=self.node, from_node=source, step=got.step, bytes=got.bytes,
                       seconds=round(got.seconds, 4), verified=True)
            keep_newest(directory, self.keep)

    def close(self, timeout_s: float = 120.0) -> None:
        """End of training: the snapshot being sent finishes, the targets are told, the receivers end."""
        if self.threads:
            self.offers.put(None)
            for thread in self.threads:
                thread.join(timeout_s)


def fetch(plan: dict[int, int], step: int, ring: Ring, group: Any, node: int, memory_dir: Path,
          event: Callable[..., None]) -> str | None:
    """A restore after a lost node (every lead; ``plan``: node → the node holding its replica of ``step``):
    serve the replicas this node holds to the nodes that need them, and receive this node's own shards into its
    memory directory when it needs them; what went wrong here, or None."""
    serving = sorted(target for target, holder in plan.items() if holder == node and target != node)
    problem: list[str] = []
    receiver = None
    if node in plan:
        def receive() -> None:
            try:
                got = receive_snapshot(memory_dir, ring.leads[plan[node]], group, TAG_FETCH)
            except Exception as exc:  # noqa: BLE001 - the holder failed: the restore fails everywhere
                problem.append(f"node {node}: fetching step {step} from node {plan[node]}: {type(exc).__name__}: {exc}")
                return
            if got is None or got.problem is not None:
                problem.append(f"node {node}: the replica of step {step} from node {plan[node]} does not verify: "
                               f"{got.problem if got else 'nothing sent'}")
                return
            event("peer_fetched", node=node, step=step, peer=plan[node], bytes_moved=got.bytes,
                  seconds=round(got.seconds, 4), snapshot=str(got.path), verified=True)
        receiver = threading.Thread(target=receive, name="ckptrun-replica-fetch", daemon=True)
        receiver.start()
    for target in serving:
        replica = store.replica_dir(memory_dir, target) / store.snapshot_name(step)
        try:
            if not (replica / MANIFEST_NAME).is_file():  # gone since the teardown: the receiver hears so, not silence
                send_end(ring.leads[target], group, TAG_FETCH)
                problem.append(f"node {node}: its replica of node {target}'s step {step} is gone")
                continue
            good = send_snapshot(replica, ring.leads[target], group, TAG_FETCH)
        except Exception as exc:  # noqa: BLE001 - a replica that cannot even be read: the receiver fails too
            problem.append(f"node {node}: sending node {target}'s replica of step {step}: {type(exc).__name__}: {exc}")
            continue
        if not good:  # it did not verify on arrival: this copy is damaged, never offered again
            shutil.rmtree(replica, ignore_errors=True)
            event("replica_dropped", node=node, of_node=target, step=step, reason="failed its digests on arrival")
    if receiver is not None:
        receiver.join()
    return problem[0] if problem else None
