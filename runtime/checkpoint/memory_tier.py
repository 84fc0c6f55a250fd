"""The memory tier, worker side: a snapshot every few steps into node-local shared memory the supervisor owns.

A memory snapshot is an ordinary snapshot (contract C2: stage, persist,
publish; the same manifest, digests and atomic rename, written by the same
:class:`~ckptrun.runtime.checkpoint.saver.Saver`) in ``RunEnv.memory_dir``, a directory
in ``/dev/shm`` that the supervisor creates, names in C1 and deletes when the
run ends (:mod:`ckptrun.cli.supervision.memory_tier`). It outlives a crashed
rank because no rank owns it, so a restart on this node restores from it when
it is newer than the newest durable snapshot: the work lost to a rank crash
falls to a few steps while durable snapshots keep their own cadence. It dies
with the node, as it should.

On many nodes the Saver runs over a group of this node's ranks (:func:`collectives.node_group`), so each
node's directory holds a snapshot of exactly its own ranks' shards (one copy of what is replicated), with
its own manifest; the cadence advice and the failure count that switches the tier off are agreed job-wide
in one small gather per memory save (a node that stopped saving alone would leave the others waiting). Each
node's lead also sends every memory snapshot it published to ``memory_replicas`` other nodes, verified on
receipt, and a restore after a lost node fetches that node's shards from a replica (:mod:`replication`).

Why a Saver of its own (its own staging buffers, writer thread and process
group) rather than the durable one's: shared buffers would make each memory
save wait for, or skip, the durable save in flight, and a durable save on a
slow disk or an object store lasts far longer than the few steps between
memory saves. The price is a second host copy of this rank's state (its
staging buffers) besides the ``memory_keep`` copies in /dev/shm. The Saver's
preflight refuses a memory save that /dev/shm or host memory cannot hold;
three failed memory saves in a row switch the tier off for the attempt (a
warning and an event). The run never stops for the memory tier: the durable
snapshots are the record.

Cadence: every N steps by the step number, so every rank agrees without a
word. ``auto``: rank 0 measures what each memory save costs the loop (its
stall) and the step time since the previous one, and sets
N = ⌈stall ÷ (1% × step time)⌉; N reaches the other ranks at the next memory
save, in one small broadcast on the tier's own group once the previous save
has settled, so the ranks always agree on the next due step. A memory save
due while the previous one is still being written waits for it (``waited_s``
of its ``memory_saved`` event), so the work lost to a crash stays within N
steps: pick N so that a write fits in N steps, or ``auto``, whose measured
stall includes that wait.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ckptrun.runtime import collectives, hashing, records
from ckptrun.runtime.storage import store
from ckptrun.runtime.env import RunEnv
from ckptrun.runtime.checkpoint import replication
from ckptrun.runtime.checkpoint.saver import Saver
from ckptrun.runtime.checkpoint.snapshot import FaultHook, SaveResult, SnapshotInfo, State

AUTO_OVERHEAD = 0.01  # auto: a memory save may cost the loop this share of its time
FAILURES_TO_STOP = 3  # failed memory saves in a row that switch the tier off for the attempt
STALL_WINDOW = 9  # auto: the median of this many measured stalls sets the pace


def steps_between(stall_s: float, step_s: float, overhead: float = AUTO_OVERHEAD) -> int:
    """Steps between memory saves that keep one save's stall within ``overhead`` of the training time."""
    if step_s <= 0 or stall_s <= 0:
        return 1
    return max(1, math.ceil(stall_s / (overhead * step_s)))


@dataclass
class MemoryCadence:
    """Every ``every`` steps: by the step number (fixed N), or since the last memory save (auto)."""

    every: int
    auto: bool = False
    last_step: int | None = None

    def due(self, step: int) -> bool:
        if self.every <= 0 or step <= 0:
            return False
        if self.auto:
            return self.last_step is None or step - self.last_step >= self.every
        return step % self.every == 0


def apply_memory_retention(memory_dir: Path, ckpt_dir: Path, keep: int) -> list[Path]:
    """Keep the newest ``keep`` memory snapshots of the current lineage (the durable dir's); delete the rest,
    abandoned lines included: this is a cache, the durable snapshots are the record."""
    lineage = store.read_lineage(ckpt_dir)
    found = store.published(memory_dir)
    current = sorted((e for e, m in found if lineage is None or lineage.contains(m)), key=lambda e: e.step)
    doomed = [e for e, m in found if lineage is not None and not lineage.contains(m)] + current[:-max(1, keep)]
    for entry in doomed:
        store.delete_snapshot(entry.path)
    return [entry.path for entry in doomed]


class MemoryTier:
    """The tier of one rank: off (``due`` is never true) unless the supervisor named a memory directory."""

    def __init__(self, env: RunEnv, run_dir: Path) -> None:
        self.dir = env.memory_dir if env.memory_every_steps and env.memory_dir is not None else None
        self.run_dir, self.ckpt_dir, self.keep, self.attempt = run_dir, env.checkpoint_dir, env.memory_keep, env.attempt
        auto = env.memory_every_steps == "auto"
        self.cadence = MemoryCadence(1 if auto else int(env.memory_every_steps or 0), auto)
        placement = collectives.node_of_each_rank() if self.dir is not None else [0]  # every rank: the same env
        self.nodes = len(set(placement))
        node_group = collectives.node_group(placement) if self.nodes > 1 else None  # each node keeps its own shards
        self.saver = Saver(self.dir, hashing.memory_algorithm(env.hash_algorithm), asynchronous=True, group=node_group) if self.dir is not None else None
        self.job_group = collectives.new_group() if self.nodes > 1 else None  # the cadence and failures, agreed job-wide
        self.rank = collectives.rank()
        self.lead = self.saver is not None and collectives.rank(self.saver.group) == 0  # writes this node's memory dir
        self.node = int(os.environ.get("GROUP_RANK", "0"))
        self.failures, self.last_error = 0, None  # failed memory saves in a row, counted alike on every rank
        self.stalls: list[float] = []
        self.last_end: float | None = None  # rank 0 (auto): when the previous memory save returned to the loop
        self.previous_step: int | None = None  # ... and its step
        self.step_s = 0.0  # rank 0 (auto): seconds per training step between the last two memory saves
        self.told_first = False
        self.ring, self.leads_group, self.replicator, self.fetch_plan = None, None, None, {}
        if self.nodes > 1:  # replicas of each node's memory snapshots on the next nodes of a ring, by the leads
            groups = collectives.all_gather_object(env.node_group)  # each node's failure domain (--node-group)
            self.ring = replication.Ring.of(placement, 1 if env.memory_replicas is None else env.memory_replicas, groups)
            self.fetch_plan = dict(env.memory_fetch)
            if self.ring.replicas or self.fetch_plan:
                self.leads_group = replication.leads_group(self.ring)
            if self.ring.replicas and self.lead:
                self.replicator = replication.Replicator(self.ring, self.leads_group, self.node, self.dir,  # type: ignore[arg-type]
                                                         self.keep, self._event)

    def _event(self, name: str, **fields: object) -> None:
        records.log_event(self.run_dir, name, attempt=self.attempt, **fields)

    def fetch(self, snapshot: Path) -> str | None:
        """Before a restore from memory (every rank): the nodes the leader named fetch their shards of
        ``snapshot``'s step from the node holding a replica (C1 ``memory_fetch``); what went wrong on any node
        (every rank gets the same answer), or None."""
        if self.ring is None or not self.fetch_plan or not self.holds(snapshot):
            return None
        step = int(store.SNAPSHOT_RE.match(snapshot.name).group(1))  # type: ignore[union-attr]
        problem = replication.fetch(self.fetch_plan, step, self.ring, self.leads_group, self.node, self.dir,  # type: ignore[arg-type]
                                    self._event) if self.lead else None
        problems = [p for p in collectives.all_gather_object(problem) if p]
        return problems[0] if problems else None

    @property
    def on(self) -> bool:
        return self.saver is not None

    def holds(self, snapshot: Path) -> bool:
        """Whether ``snapshot`` lives in this tier (a restore from it is not durable)."""
        return self.dir is not None and snapshot.parent.resolve() == self.dir.resolve()

    def due(self, step: int) -> bool:
        return self.saver is not None and self.cadence.due(step)

    def settle(self, wait: bool = False) -> None:
        """Account for finished memory saves (``wait``: the one in flight too); every rank sees the same results."""
        if self.saver is not None:
            self._account(self.saver.collect(wait))

    def save(self, state: State, info: SnapshotInfo, fault: FaultHook = lambda phase: None) -> None:
        """Start a memory save at this step boundary (every rank, the same step); returns once staged.
        ``fault``: the test faults' hook at each phase of the save (``memory-enospc``)."""
        started = time.monotonic()
        self.settle(wait=True)  # one in flight at most; its group is free for the broadcast below
        waited = time.monotonic() - started  # a write that outlasts the cadence shows here (memory_saved stall_s)
        advice = self._advice(info.step) if self.cadence.auto and self.rank == 0 else None
        if self.job_group is not None:  # many nodes: each node saw its own results; the worst one counts everywhere
            rows = collectives.all_gather_object((self.failures, advice), group=self.job_group)
            self.failures, advice = max(row[0] for row in rows), rows[0][1]
        if self.failures >= FAILURES_TO_STOP:  # every rank has collected the same results by now: they agree
            return self._switch_off()
        if self.cadence.auto:
            self.cadence.every = advice if self.job_group is not None else \
                collectives.broadcast_object(advice, group=self.saver.group)
        if self.lead:  # a step saved again after a restart from an older snapshot: the newer save replaces it
            stale = self.dir / store.snapshot_name(info.step)  # type: ignore[operator]
            if stale.exists():
                store.delete_snapshot(stale)
        if self.replicator is not None:
            self.replicator.start()
        self.saver.begin(state, info, fault=fault, on_result=self._on_result, waited=waited)
        self.cadence.last_step = info.step
        self._measured(info.step, started)

    def _measured(self, step: int, started: float) -> None:
        """Rank 0 (auto): this save's stall and the step time since the previous one, for the next cadence."""
        if self.rank != 0:
            return
        now = time.monotonic()
        self.stalls = (self.stalls + [now - started])[-STALL_WINDOW:]
        if self.last_end is not None and self.previous_step is not None and step > self.previous_step:
            self.step_s = (started - self.last_end) / (step - self.previous_step)
        self.last_end, self.previous_step = now, step

    def _advice(self, step: int) -> int:
        """Rank 0: N from the median stall and the step time measured so far (1 until both are known)."""
        if not self.stalls or self.step_s <= 0:
            return self.cadence.every
        every, old = steps_between(statistics.median(self.stalls), self.step_s), self.cadence.every
        if abs(every - old) <= 0.2 * old:  # jitter of the clocks: keep the pace (one event per real change)
            return old
        records.log_event(self.run_dir, "memory_cadence", step=step, attempt=self.attempt, every_steps=every,
                          stall_s=statistics.median(self.stalls), step_s=self.step_s, overhead=AUTO_OVERHEAD)
        return every

    def _on_result(self, result: SaveResult) -> None:
        """Every rank, on the writer thread: each node's first rank records its node's save and applies the
        tier's retention to its node's directory."""
        if not self.lead:
            return
        node = {"node": self.node} if self.nodes > 1 else {}
        if result.ok:
            records.log_event(self.run_dir, "memory_saved", step=result.step, path=str(result.path), bytes=result.bytes,
                              stall_s=result.stall_s, waited_s=result.waited_s, write_s=result.persist_s + result.publish_s,
                              attempt=self.attempt, **node)
            apply_memory_retention(self.dir, self.ckpt_dir, self.keep)  # type: ignore[arg-type]
            if self.replicator is not None:
                self.replicator.offer(result.path)  # type: ignore[arg-type]
            if not self.told_first:
                self.told_first = True
                print(f"ckptrun: memory tier: step {result.step} in {self.dir} "
                      f"({result.bytes / 2**20:.1f} MiB, written in {result.persist_s + result.publish_s:.3f}s)",
                      file=sys.stderr, flush=True)
        else:
            records.log_event(self.run_dir, "memory_save_failed", step=result.step, error=result.error, attempt=self.attempt,
                              **node)
            print(f"ckptrun: memory-tier save failed at step {result.step}: {result.error}", file=sys.stderr, flush=True)

    def _account(self, results: list[SaveResult]) -> None:
        for result in results:
            self.failures = 0 if result.ok else self.failures + 1
            self.last_error = result.error

    def _switch_off(self) -> None:
        """Three failed memory saves in a row: no more for this attempt (``due`` is false from now on)."""
        if self.saver is not None:
            self.saver.close()
            self.saver = None
        if self.rank == 0:
            reason = f"{self.failures} memory saves failed in a row (last: {self.last_error})"
            records.log_event(self.run_dir, "memory_tier_off", attempt=self.attempt, reason=reason,
                              step=self.cadence.last_step)
            print(f"ckptrun: warning: memory tier off for this attempt: {reason}; durable snapshots go on",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        """End of training: the memory save in flight finishes (the supervisor deletes the directory)."""
        if self.saver is not None:
            self.settle(wait=True)
            self.saver.close()
        if self.replicator is not None:
            self.replicator.close()
