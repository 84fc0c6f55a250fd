"""The snapshot for the next attempt, verified by every node at once: each hashes a disjoint share of its files.

Between attempts the leader names a candidate in the job's store — the newest
published snapshot of the current lineage not yet refused — and every node
(the leader too) checks files ``i, i+n, i+2n…`` of its manifest, ``i`` its node
rank and ``n`` the node count, and posts its verdict. The candidate is taken
when every share is good; a snapshot any node finds bad is skipped by all (only
the leader's choice is ever relaunched) and the next one is named. A follower
verifies its share of the newest candidate as soon as its ranks are down and
sends the verdict with its teardown acknowledgement: when the leader names the
same one, that is the first round, and no round trip is spent asking. Verify
time falls with the node count; with a chunked (schema 3) manifest each share is
only a size check, since the ranks verify every byte as they load it. A node
that does not answer within
:data:`ANSWER_S` (lost, or its launcher is being replaced) has its share
hashed by the leader. A follower keeps beating while it hashes, so a long
share is not mistaken for a lost node. Importable without torch.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from ckptrun.cli.supervision.job_store import JobStore, StoreUnreachable
from ckptrun.cli.supervision.node_list import pack_nodes
from ckptrun.cli.supervision.observation import Snapshot
from ckptrun.runtime.manifest import Manifest, ManifestError, read_manifest
from ckptrun.runtime.storage.store import Entry, list_entries, read_lineage
from ckptrun.runtime.checkpoint.verify import verify_snapshot

ANSWER_S = 30.0  # a node's verdict on its share; after this the leader hashes the share itself
WAIT_S = 1.0  # the longest one wait for the verdicts lasts (a verdict's key ends it at once)
BEAT_S = 1.0  # a follower's heartbeat while it hashes its share


def check_share(job: JobStore, attempt: int, path: Path, node: int, nodes: list[int], beat: bool = False,
                manifest: Manifest | None = None) -> dict[str, Any]:
    """Node ``node``'s share of ``path`` (files ``i, i+n…``): the verdict, as posted. ``beat``: keep node
    ``node``'s heartbeat fresh meanwhile (a follower hashing its own share); ``manifest``: read already."""
    started = time.monotonic()
    share = (nodes.index(node), len(nodes))
    report = verify_snapshot(path, share=share, progress=_beating(job, node, attempt) if beat else None, at_load=True,
                             manifest=manifest)
    mine = len(report.manifest.files[share[0]::share[1]]) if report.manifest else 0
    return {"ok": report.ok, "files": mine, "seconds": time.monotonic() - started, "problems": report.problems[:5]}


def verify_share(job: JobStore, attempt: int, round: int, path: Path, node: int, nodes: list[int],
                 beat: bool = False) -> bool:
    """Node ``node``'s share of round ``round``'s candidate: hash it, post the verdict; True when it is good."""
    verdict = check_share(job, attempt, path, node, nodes, beat)
    job.post_verify(f"{attempt}.{round}", node, verdict["ok"], verdict["files"], verdict["seconds"], verdict["problems"])
    return bool(verdict["ok"])


def early_share(job: JobStore, attempt: int, ckpt_dir: Path, node: int, nodes: list[int]) -> dict[str, Any] | None:
    """A follower whose ranks are down verifies its share of the candidate the leader will most likely name —
    the first of :func:`candidates`, as it sees them now — before it acknowledges the teardown, and sends the
    verdict with the acknowledgement: when the leader's candidate is the same (path and nodes), that is round 1,
    and no verify round's two hops follow. None: no candidate here."""
    entry, manifest = next(candidates(ckpt_dir, lambda line: None), (None, None))
    if entry is None or node not in nodes:
        return None
    return {"path": str(entry.path), "nodes": pack_nodes(nodes),
            **check_share(job, attempt, entry.path, node, nodes, beat=True, manifest=manifest)}


def answer(job: JobStore, asked: dict[str, Any] | None, attempt: int, node: int, done: set[int]) -> None:
    """A follower between attempts: verify its share of the candidate the leader named for the attempt after
    ``attempt`` (``asked``: its latest verify round, from its word), once per round."""
    if asked is None or int(asked.get("attempt", -1)) != attempt or int(asked["round"]) in done \
            or node not in asked["nodes"]:
        return
    done.add(int(asked["round"]))
    verify_share(job, attempt, int(asked["round"]), Path(asked["path"]), node, list(asked["nodes"]), beat=True)


def _beating(job: JobStore, node: int, attempt: int) -> Callable[[int], None]:
    """A hashing progress callback that beats at most every :data:`BEAT_S` (the hashing threads take turns:
    the store's client is used by one thread at a time, the caller waits on the hash meanwhile)."""
    lock, last = threading.Lock(), [time.monotonic()]

    def progress(_bytes: int) -> None:
        if time.monotonic() - last[0] < BEAT_S or not lock.acquire(blocking=False):
            return
        try:
            last[0] = time.monotonic()
            with contextlib.suppress(StoreUnreachable):  # a missed beat; the verify goes on
                job.beat(node, attempt=attempt, state="verifying")
        finally:
            lock.release()

    return progress


def candidates(ckpt_dir: Path, say: Callable[[str], None]) -> Iterator[tuple[Entry, Manifest]]:
    """The published snapshots of the current lineage whose manifest reads, newest first (what :func:`choose`
    tries in turn; a follower's :func:`early_share` takes the first)."""
    lineage = read_lineage(ckpt_dir)
    for entry in sorted((e for e in list_entries(ckpt_dir, include_abandoned=False) if e.kind == "published"),
                        key=lambda e: e.step, reverse=True):
        try:
            manifest = read_manifest(entry.path)
        except ManifestError as exc:
            say(f"skipping {entry.name}: {exc}")
            continue
        if lineage is not None and not lineage.contains(manifest):
            say(f"skipping {entry.name}: not in the current lineage")
            continue
        yield entry, manifest


def choose(job: JobStore, attempt: int, ckpt_dir: Path, nodes: list[int], me: int,
           say: Callable[[str], None]) -> Snapshot | None:
    """The leader: the newest snapshot of the lineage that every node's share verifies (None: none does).
    Round 1 takes the verdicts the followers sent with their teardown acknowledgements when they are all on
    this candidate; otherwise (and for later rounds) the leader names the candidate and every node answers."""
    started = time.monotonic()
    for round, (entry, manifest) in enumerate(candidates(ckpt_dir, say), start=1):
        problems = _early_round(job, attempt, entry.path, manifest, nodes, me) if round == 1 else None
        if problems is None:
            problems = _verify_round(job, attempt, round, entry.path, nodes, me)
        if not problems:
            seconds = time.monotonic() - started
            say(f"using {entry.name}: {len(nodes)} nodes checked manifest and sizes of {manifest.total_bytes} bytes in "
                f"{seconds:.2f}s; digests verified as loaded" if manifest.verified_as_loaded else
                f"using {entry.name}: {len(nodes)} nodes verified {manifest.total_bytes} bytes in {seconds:.2f}s")
            return Snapshot(entry.path, entry.step, seconds)
        say(f"skipping {entry.name}: {'; '.join(problems[:3])}")
    return None


def _early_round(job: JobStore, attempt: int, path: Path, manifest: Manifest, nodes: list[int],
                 me: int) -> list[str] | None:
    """Round 1 from the teardown acknowledgements: the problems found, or None when a node's verdict is not
    on ``path`` over ``nodes`` (it saw another candidate, or sent none): then a verify round decides."""
    others = [n for n in nodes if n != me]
    early = {n: ack.get("verified") or {} for n, ack in job.teardown_acks(attempt, others).items()}
    asked = {"path": str(path), "nodes": pack_nodes(nodes)}
    if any({k: early.get(n, {}).get(k) for k in asked} != asked for n in others):
        return None
    early[me] = check_share(job, attempt, path, me, nodes, manifest=manifest)
    return [f"node {n}: {p}" for n, v in sorted(early.items()) if not v["ok"] for p in v["problems"] or ["bad"]]


def _verify_round(job: JobStore, attempt: int, round: int, path: Path, nodes: list[int], me: int) -> list[str]:
    """Every node's share of ``path``; the problems found (none: it verifies)."""
    job.ask_verify(attempt, round, str(path), nodes)
    verify_share(job, attempt, round, path, me, nodes)
    label, deadline = f"{attempt}.{round}", time.monotonic() + ANSWER_S
    verdicts = job.verify_verdicts(label, nodes)
    while len(verdicts) < len(nodes) and time.monotonic() < deadline:  # the last verdict's key wakes the wait
        job.wait_for_verdicts(label, [n for n in nodes if n not in verdicts], min(WAIT_S, deadline - time.monotonic()))
        verdicts = job.verify_verdicts(label, nodes)
    for missing in (n for n in nodes if n not in verdicts):  # a silent node: its share is hashed here
        verify_share(job, attempt, round, path, missing, nodes)
        verdicts = job.verify_verdicts(label, nodes)
    return [f"node {n}: {p}" for n, v in sorted(verdicts.items()) if not v["ok"] for p in v["problems"] or [v.get("status", "bad")]]
