"""Snapshots that barely stall the step: stage in the foreground, persist and publish in the background.

The training step waits only for **stage**: this rank's share of the state
(what DCP's save plan has it write, see :func:`dcp_io.owned_keys`) copied into
host buffers allocated once and reused (:mod:`staging`), so a node holds about
one copy of the state whatever the number of ranks. **Persist** and
**publish** run on one background thread at lower CPU and I/O priority (and,
with a duty below 1, paced: :mod:`pacing`), with
their collectives on a process group of their own (gloo), so they never
interleave with the step's collectives; publish waits until every rank's
write has finished, agreed over that group. At most one save is
in flight: a save due while one runs waits for it (``--save-overlap skip``: the
step exchange skips it when every rank's saver is busy, :mod:`ckptrun.runtime.step.safeguards`).
Staged floats that are not finite are never published (``save_refused``,
cause ``non-finite``). ``sync`` runs the same code inline.
With an object store, the background writer also uploads each published
snapshot and commits it there (:mod:`remote_publish`).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import psutil
import torch

from ckptrun.runtime import collectives, hashing
from ckptrun.runtime.checkpoint import pacing
from ckptrun.runtime.storage import store
from ckptrun.runtime.checkpoint.node_cache import NodeCache
from ckptrun.runtime.checkpoint.remote_publish import evict_staging, upload
from ckptrun.runtime.checkpoint.replicas import compare, digests
from ckptrun.runtime.storage.remote_store import FsspecStore
from ckptrun.runtime.checkpoint.save_plan import OwnedKeys
from ckptrun.runtime.checkpoint.snapshot import FaultHook, SaveResult, SnapshotInfo, State, persist_and_publish
from ckptrun.runtime.checkpoint.staging import Stager, first_nonfinite, local_bytes

DISK_MARGIN = 1.10
DISK_SLACK = 4 << 20
WRITER_NICE = 10  # quiet 2 cores, 64 MiB, probe loop alongside: 5 -> slowdown ~1.45, persist 0.32 s;
# 10 -> ~1.15, 0.73 s; 19 -> ~1.0, 2.8 s; SCHED_IDLE -> 15 s (starved). Its threads (hashing, fsyncs) inherit it.
WRITER_DUTY = 1.0  # share of wall time the writer may be busy between pauses (runtime.pacing); 1.0: no pauses.
# Not yet shown to help (only under load 9-14, where noise exceeds the effect); bench/writer_settings.py A/Bs both.


def lower_priority(nice: int = WRITER_NICE) -> None:
    """The calling background thread (the writer, a replica's sender or receiver) yields CPU and disk to
    training (Linux niceness and I/O priority are per thread)."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
        psutil.Process(tid).ionice(psutil.IOPRIO_CLASS_BE, 7)
    except (OSError, psutil.Error, AttributeError):
        pass


SCANNED = ("model.", "ema.")  # the weights: a blow-up shows there (and in the loss) first


def weights(state: State) -> dict[str, torch.Tensor]:
    """The staged tensors the finiteness check reads: the tracked model's (and EMA's) weights, not the optimizer
    moments twice their size (a NaN there reaches the weights and the loss at the next step, where the loss
    checks and a poisoned restore's blame catch it); every tensor when the run tracks no ``model``."""
    if "model" not in state.shared_tree.get("objects", {}):
        return state.shared_tensors
    return {key: tensor for key, tensor in state.shared_tensors.items() if key.startswith(SCANNED)}


class Saver:
    """Owns the staging buffers, the snapshot process group and the background writer."""

    def __init__(self, ckpt_dir: Path, algorithm: str, asynchronous: bool, overlap: str = "wait",
                 remote: FsspecStore | None = None, keep_local: bool = True, nice: int | None = None,
                 duty: float | None = None, group: Any = None, node_cache: NodeCache | None = None) -> None:
        self.ckpt_dir, self.algorithm, self.asynchronous, self.overlap = ckpt_dir, algorithm, asynchronous, overlap
        self.duty = WRITER_DUTY if duty is None else duty  # background writer only; ``nice`` likewise
        self.remote, self.keep_local = remote, keep_local  # an object store: each save is uploaded after its local publish
        self.node_cache = node_cache  # many nodes, --local-cache: this node's own files of each upload, kept
        self.group = group if group is not None else collectives.new_group()  # ``group``: a node's own snapshots
        self.stager = Stager()
        self.owned = OwnedKeys()
        self.scanner = ThreadPoolExecutor(1, "ckptrun-finite")  # the staged floats' finiteness, beside the persist
        self.pool = ThreadPoolExecutor(1, "ckptrun-persist", initializer=lower_priority,
                                       initargs=(WRITER_NICE if nice is None else nice,)) if asynchronous else None
        self.pending: Future | None = None
        self.finished: list[SaveResult] = []
        self.last_bytes = 0
        self.paused_s = 0.0  # seconds the background writer has spent in pacing pauses, all saves together
        self.last_published: tuple[int, str] | None = None  # (step, tensor digest) of this process's last save

    def busy(self) -> bool:
        """This rank's previous save is still being written (a fact of this rank only)."""
        return self.pending is not None and not self.pending.done()

    def begin(self, state: State, info: SnapshotInfo, fault: FaultHook,
              on_result: Callable[[SaveResult], None], waited: float = 0.0) -> None:
        """Start a save at this step boundary; its result reaches ``on_result`` (every rank) and :meth:`collect`.

        Sync: done when this returns. Async: only staged; a refused preflight is a
        failed result at once.
        """
        started = time.monotonic()
        waited += self._settle(wait=True)
        owned = self.owned(state.shared_tensors, self.group, state.first_rank_keys)
        mine = {key: tensor for key, tensor in state.shared_tensors.items() if key in owned}
        problem = self._preflight(state, mine)
        if problem:
            return self._refused(info.step, f"preflight: {problem}", on_result)
        temp_dir = self._new_temp_dir(info.step)
        fault("stage")
        copies = self.pool is not None or any(not t.is_cpu for t in mine.values())
        allocated = self.stager.bytes_needed(mine) if copies else 0
        staged = State(state.shared_tree, self._stage(mine), state.rank_tree,
                       {k: t.detach().to("cpu", copy=True) for k, t in state.rank_tensors.items()},
                       staged_bytes=local_bytes(mine) if copies else 0, allocated_bytes=allocated)
        replicas = digests({k: v for k, v in state.shared_tensors.items() if k not in state.first_rank_keys}) \
            if collectives.world_size(self.group) > 1 else {}  # every rank's replica; DDP buffers are rank 0's by design
        stall = time.monotonic() - started + waited
        rss = psutil.Process().memory_info().rss

        def work() -> SaveResult:
            self.stager.fence()
            background = self.pool is not None
            scan = self.scanner.submit(first_nonfinite, weights(staged))  # beside the persist: torch's scan releases
            # the GIL, so a sync save's stall pays it only where the persist does not already take longer

            def agree() -> SaveResult | None:
                return self._agreed_values(info.step, scan.result(), replicas, temp_dir)

            with pacing.paced(self.duty if background else 1.0) as pacer, (hashing.helpers(1) if background else nullcontext()):
                persisted = persist_and_publish(temp_dir, staged, info, self.algorithm, fault, self.group, agree=agree)
            self.paused_s += pacer.paused_s
            if persisted.refused is not None:  # written but never published: the temp dir is gone
                fault("done")
                on_result(persisted)
                if collectives.world_size(self.group) > 1:  # rank 0 recorded it before any rank acts on it (and may exit)
                    collectives.barrier(group=self.group)
                return persisted
            result = replace(persisted, stall_s=stall, waited_s=waited, asynchronous=self.asynchronous,
                             staging_allocated_bytes=allocated, rss_after_stage_bytes=rss)
            if result.ok and self.remote is not None:
                result = upload(result, temp_dir, self.remote, self.keep_local, fault, self.group, cache=self.node_cache)
            fault("done")
            if result.ok:
                self.last_bytes = result.bytes
                result = self._check_stale(result)
            on_result(result)
            return result

        if self.pool is None:
            self.finished.append(work())
        else:
            self.pending = self.pool.submit(work)

    def _new_temp_dir(self, step: int) -> Path:
        """Rank 0 creates the save's temp dir and tells the others (a world of one needs no broadcast)."""
        if collectives.world_size(self.group) == 1:
            return store.new_temp_dir(self.ckpt_dir, step)
        made = store.new_temp_dir(self.ckpt_dir, step) if collectives.rank(self.group) == 0 else None
        return collectives.broadcast_object(made, group=self.group)

    def _stage(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Async: copy into the reused buffers. Sync: the step waits for the whole save anyway, so CPU
        tensors are written as they are (no copy); device tensors still come to host."""
        if self.pool is not None or any(not t.is_cpu for t in tensors.values()):
            return self.stager.stage(tensors)
        return {key: tensor.detach() for key, tensor in tensors.items()}

    def _agreed_values(self, step: int, problem: str | None, replicas: dict[str, int],
                       temp_dir: Path) -> SaveResult | None:
        """Every rank's staged floats finite (``problem``: this rank's scan) and its replicas equal to the others',
        agreed in one gather over the snapshot group once the files are written, before anything is published;
        else the refused result (the same on every rank), and the temp dir is removed."""
        refused = None
        if collectives.world_size(self.group) > 1:
            rows = collectives.all_gather_object((problem, replicas), group=self.group)
            found = [f"rank {r}: {row[0]}" for r, row in enumerate(rows) if row[0]]
            problem = found[0] if found else None
            diverged = compare([row[1] for row in rows])
            if problem is None and diverged is not None:
                refused = SaveResult(False, step, error=diverged.describe(), refused="replicas-diverged",
                                     diverged=(diverged.tensor, diverged.ranks))
        if problem is not None:
            refused = SaveResult(False, step, error=problem, refused="non-finite")
        if refused is not None and collectives.rank(self.group) == 0:
            shutil.rmtree(temp_dir, ignore_errors=True)
        return refused

    def _check_stale(self, result: SaveResult) -> SaveResult:
        """Two saves at different steps whose tensor bytes are all identical: staging read stale buffers
        (or training changed nothing). Noted in the result as the earlier step."""
        previous, self.last_published = self.last_published, (result.step, result.tensor_digest)
        if previous and previous[0] != result.step and previous[1] == result.tensor_digest:
            return replace(result, stale_of=previous[0])
        return result

    def _refused(self, step: int, error: str, on_result: Callable[[SaveResult], None]) -> None:
        result = SaveResult(False, step, error=error, skipped=True)
        on_result(result)
        self.finished.append(result)

    def _settle(self, wait: bool) -> float:
        """Move the in-flight save's result to ``finished`` once it is done (or wait for it); seconds waited."""
        if self.pending is None or (not wait and not self.pending.done()):
            return 0.0
        started = time.monotonic()
        result = self.pending.result()
        self.pending = None
        self.finished.append(result)
        return time.monotonic() - started

    def collect(self, wait: bool = False) -> list[SaveResult]:
        """Results of saves finished since the last call (with ``wait``, the in-flight one too)."""
        self._settle(wait)
        out, self.finished = self.finished, []
        return out

    def _preflight(self, state: State, mine: dict[str, torch.Tensor]) -> str | None:
        """Enough disk for the expected bytes and host memory for this rank's new staging buffers, agreed by all ranks."""
        tensor_bytes = sum(t.numel() * t.element_size() for t in state.shared_tensors.values())
        expected = max(self.last_bytes, tensor_bytes)
        problem = None
        try:
            free = shutil.disk_usage(self.ckpt_dir).free
        except OSError as exc:
            free, problem = 0, f"{self.ckpt_dir} is not accessible ({exc.strerror})"
        if problem is None and free < expected * DISK_MARGIN + DISK_SLACK:
            problem = f"{free / 2**20:.0f} MiB free in {self.ckpt_dir}, a snapshot needs ~{expected / 2**20:.0f} MiB"
        new_buffers = self.stager.bytes_needed(mine)
        if problem is None and new_buffers and psutil.virtual_memory().available < new_buffers * DISK_MARGIN:
            problem = f"staging needs {new_buffers / 2**20:.0f} MiB of host memory, {psutil.virtual_memory().available / 2**20:.0f} MiB available"
        if collectives.world_size(self.group) == 1:
            return problem
        problems = [p for p in collectives.all_gather_object(problem, group=self.group) if p]
        return problems[0] if problems else None

    def empty_staging(self) -> None:
        """A store run without ``--local-cache``, at its end (every rank, no save in flight): rank 0 removes every
        local snapshot once all ranks are done reading. Each upload's commit removes its own, but a restart's
        download that is not saved again (a restart from the final snapshot) would stay; the store holds it."""
        if self.remote is None or self.keep_local:
            return
        collectives.barrier(group=self.group)  # a peer may still be reading the restored copy
        if collectives.rank(self.group) == 0:
            evict_staging(self.ckpt_dir)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        self.scanner.shutdown(wait=True)
