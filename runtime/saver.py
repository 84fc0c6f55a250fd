"""Snapshots that barely stall the step: stage in the foreground, persist and publish in the background.

The training step waits only for **stage**: the state copied into host buffers
allocated once and reused (pinned, and copied on a side stream, when the state
lives on a GPU). **Persist** and **publish** run on one background thread at
lower CPU and I/O priority, with their collectives on a process group of their
own, so they never interleave with the step's collectives. At most one save is
in flight: a save due while one runs waits for it (or, with ``overlap="skip"``,
is skipped), with an event either way. ``sync`` runs the same code inline.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import psutil
import torch

from ckptrun.runtime import collectives, store
from ckptrun.runtime.snapshot import FaultHook, SaveResult, SnapshotInfo, State, persist_and_publish

DISK_MARGIN = 1.10
DISK_SLACK = 4 << 20


class Stager:
    """Host buffers allocated once and reused by every save (first touch of new memory is slow)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._event: Any = None

    def bytes_needed(self, tensors: dict[str, torch.Tensor]) -> int:
        """Bytes of buffers this stage would have to allocate (0 once they exist)."""
        return sum(t.numel() * t.element_size() for k, t in tensors.items() if not self._fits(k, t))

    def _fits(self, key: str, tensor: torch.Tensor) -> bool:
        buffer = self._buffers.get(key)
        return buffer is not None and buffer.shape == tensor.shape and buffer.dtype == tensor.dtype

    def stage(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy into the buffers; device tensors go device-to-host on a side stream (see :meth:`fence`)."""
        stream = torch.cuda.Stream() if any(t.is_cuda for t in tensors.values()) else None
        staged = {}
        with torch.cuda.stream(stream) if stream is not None else _null():
            for key, tensor in tensors.items():
                if not self._fits(key, tensor):
                    self._buffers[key] = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=tensor.is_cuda)
                self._buffers[key].copy_(tensor.detach(), non_blocking=tensor.is_cuda)
                staged[key] = self._buffers[key]
        if stream is not None:
            self._event = torch.cuda.Event()
            self._event.record(stream)
        return staged

    def fence(self) -> None:
        """Before the next optimizer step touches the weights, and before persisting: the copy is done."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _lower_priority() -> None:
    """The writer thread yields CPU and disk to training (Linux niceness and I/O priority are per thread)."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, 5)  # 10 starved the writer (persist 7x slower while training)
        psutil.Process(tid).ionice(psutil.IOPRIO_CLASS_BE, 7)
    except (OSError, psutil.Error, AttributeError):
        pass


class Saver:
    """Owns the staging buffers, the snapshot process group and the background writer."""

    def __init__(self, ckpt_dir: Path, algorithm: str, asynchronous: bool, overlap: str = "wait") -> None:
        self.ckpt_dir, self.algorithm, self.asynchronous, self.overlap = ckpt_dir, algorithm, asynchronous, overlap
        self.group = collectives.new_group()
        self.stager = Stager()
        self.pool = ThreadPoolExecutor(1, "ckptrun-persist", initializer=_lower_priority) if asynchronous else None
        self.pending: Future | None = None
        self.finished: list[SaveResult] = []
        self.last_bytes = 0

    def busy(self) -> bool:
        return self.pending is not None and not self.pending.done()

    def begin(self, state: State, info: SnapshotInfo, fault: FaultHook,
              on_result: Callable[[SaveResult], None], waited: float = 0.0) -> None:
        """Start a save at this step boundary; its result reaches ``on_result`` (every rank) and :meth:`collect`.

        Sync: done when this returns. Async: only staged; a refused preflight or a
        skip by the overlap policy is a failed result at once.
        """
        started = time.monotonic()
        if self.busy() and self.overlap == "skip":
            return self._refused(info.step, "skipped: the previous save is still in flight", on_result)
        waited += self._settle(wait=True)
        problem = self._preflight(state)
        if problem:
            return self._refused(info.step, f"preflight: {problem}", on_result)
        rank = collectives.rank()
        temp_dir = collectives.broadcast_object(store.new_temp_dir(self.ckpt_dir, info.step) if rank == 0 else None, group=self.group)
        fault("stage")
        allocated = self.stager.bytes_needed(state.shared_tensors) if self.pool is not None else 0
        staged = State(state.shared_tree, self._stage(state.shared_tensors), state.rank_tree,
                       {k: t.detach().to("cpu", copy=True) for k, t in state.rank_tensors.items()})
        stall = time.monotonic() - started + waited
        rss = psutil.Process().memory_info().rss

        def work() -> SaveResult:
            self.stager.fence()
            result = replace(persist_and_publish(temp_dir, staged, info, self.algorithm, fault, self.group),
                             stall_s=stall, waited_s=waited, asynchronous=self.asynchronous,
                             staging_allocated_bytes=allocated, rss_after_stage_bytes=rss)
            fault("done")
            if result.ok:
                self.last_bytes = result.bytes
            on_result(result)
            return result

        if self.pool is None:
            self.finished.append(work())
        else:
            self.pending = self.pool.submit(work)

    def _stage(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Async: copy into the reused buffers. Sync: the step waits for the whole save anyway, so CPU
        tensors are written as they are (no copy); device tensors still come to host."""
        if self.pool is not None or any(not t.is_cpu for t in tensors.values()):
            return self.stager.stage(tensors)
        return {key: tensor.detach() for key, tensor in tensors.items()}

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

    def _preflight(self, state: State) -> str | None:
        """Enough disk for the expected bytes and host memory for new staging buffers, agreed by all ranks."""
        tensor_bytes = sum(t.numel() * t.element_size() for t in state.shared_tensors.values())
        expected = max(self.last_bytes, tensor_bytes)
        problem = None
        try:
            free = shutil.disk_usage(self.ckpt_dir).free
        except OSError as exc:
            free, problem = 0, f"{self.ckpt_dir} is not accessible ({exc.strerror})"
        if problem is None and free < expected * DISK_MARGIN + DISK_SLACK:
            problem = f"{free / 2**20:.0f} MiB free in {self.ckpt_dir}, a snapshot needs ~{expected / 2**20:.0f} MiB"
        new_buffers = self.stager.bytes_needed(state.shared_tensors)
        if problem is None and new_buffers and psutil.virtual_memory().available < new_buffers * DISK_MARGIN:
            problem = f"staging needs {new_buffers / 2**20:.0f} MiB of host memory, {psutil.virtual_memory().available / 2**20:.0f} MiB available"
        problems = [p for p in collectives.all_gather_object(problem, group=self.group) if p]
        return problems[0] if problems else None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
