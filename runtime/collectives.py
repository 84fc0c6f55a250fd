"""Thin wrappers over torch.distributed that degrade to no-ops in a single process.

On CUDA the worker joins one process group with two backends: the decisions
the ranks share (this module's collectives, the fp16 found-inf flag, snapshot
coordination) are CPU tensors and ride gloo; model tensors (DDP, FSDP2) stay
on the device and ride NCCL. An NCCL-only group rejects CPU tensors: when the
script made the default group itself (``dist.init_process_group("nccl")`` before
``ckr.init()``, as most GPU scripts do), :func:`ensure_cpu_group` adds a gloo group
of all ranks beside it and every collective here rides that one.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
import torch.distributed as dist


CUDA_BACKEND = "cpu:gloo,cuda:nccl"
CPU = torch.device("cpu")
_cpu_group: Any = None  # a gloo group beside a default group without a CPU backend (ensure_cpu_group)


class NoCpuBackend(RuntimeError):
    """The default process group cannot carry CPU tensors and no gloo group can be added."""


def has_cpu_backend(config: str) -> bool:
    """Whether a backend config (``dist.get_backend_config()``: "gloo", "nccl", "cpu:gloo,cuda:nccl") carries
    CPU tensors: a ``cpu:`` entry, or a backend torch registers for the CPU device."""
    for part in config.lower().split(","):
        device, _, backend = part.strip().rpartition(":")
        if device == "cpu" or (not device and "cpu" in dist.Backend.backend_capability.get(backend, [])):
            return True
    return False


def ensure_cpu_group() -> Any:
    """The group this module's collectives use: the default one when it carries CPU tensors, else a gloo group
    of all ranks made once, now (every rank calls this at the same point: ``init()``)."""
    global _cpu_group
    if _cpu_group is not None or not active() or has_cpu_backend(dist.get_backend_config()):
        return _cpu_group
    if not dist.is_gloo_available():
        raise NoCpuBackend(f"the default process group ({dist.get_backend_config()}) carries no CPU tensors and this "
                           "torch has no gloo; create it with backend=\"cpu:gloo,cuda:nccl\"")
    _cpu_group = dist.new_group(backend="gloo")
    return _cpu_group


def _group(group: Any) -> Any:
    return _cpu_group if group is None else group


def backend_for(device_type: str) -> str:
    """The process group's backend string for a worker whose model lives on ``device_type``."""
    return CUDA_BACKEND if device_type == "cuda" else "gloo"


def worker_device(cuda: bool | None = None) -> torch.device:
    """This worker's device: LOCAL_RANK's GPU when CUDA is available (``cuda``: decided by the caller), else the CPU."""
    if torch.cuda.is_available() if cuda is None else cuda:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return CPU


def start(device: torch.device, set_device: Callable[[torch.device], None] = torch.cuda.set_device) -> None:
    """Join the default group for a model on ``device`` (GPU: bound first, so NCCL and FSDP2 use it)."""
    if device.type == "cpu":
        dist.init_process_group(backend_for("cpu"))
        return
    set_device(device)
    dist.init_process_group(backend_for(device.type), device_id=device)


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank(group: Any = None) -> int:
    """This rank's number in ``group`` (None: the whole job)."""
    return dist.get_rank(group) if active() else 0


def world_size(group: Any = None) -> int:
    """The ranks in ``group`` (None: the whole job)."""
    return dist.get_world_size(group) if active() else 1


def barrier(group: Any = None) -> None:
    if active():
        dist.barrier(group=_group(group))


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """Rank ``src``'s object on every rank (ranks here are our own workers: pickling is trusted)."""
    if not active():
        return obj
    box = [obj]
    if group is None:
        dist.broadcast_object_list(box, src=src, group=_cpu_group, device=CPU)
    else:  # ``src`` numbers the rank within ``group`` (a node's group: its first rank is not the job's rank 0)
        dist.broadcast_object_list(box, group_src=src, group=group, device=CPU)
    return box[0]


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's object (on CPU: torch picks gloo when the group has a CPU backend)."""
    if not active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(_group(group))
    dist.all_gather_object(out, obj, group=_group(group))
    return out


def new_group() -> Any:
    """A gloo group of all ranks for snapshot traffic, so a background save never
    interleaves its collectives with the training step's on the default group."""
    return dist.new_group(backend="gloo") if active() else None


def node_of_each_rank() -> list[int]:
    """Every rank's node (torchrun's ``GROUP_RANK``), in rank order: one gather, every rank at the same point."""
    return all_gather_object(int(os.environ.get("GROUP_RANK", "0")))


def node_group(nodes: list[int]) -> Any:
    """A gloo group of the ranks on this node, from :func:`node_of_each_rank`, for node-local snapshots (the memory
    tier on many nodes); every rank calls it at the same point, and each gets its own node's group."""
    if not active():
        return None
    members = [[r for r, n in enumerate(nodes) if n == node] for node in sorted(set(nodes))]
    mine, _ = dist.new_subgroups_by_enumeration(members, backend="gloo")
    return mine


def all_reduce_sum(values: list[float]) -> list[float]:
    """Sum a few float64 values over ranks in one collective, waiting for it (e.g. the fp16 skip flag)."""
    return start_sum(values).result()


class PendingSum:
    """A sum over ranks started now and read later: ``result()`` waits for it (by then it is usually done)."""

    def __init__(self, values: list[float], tensor: torch.Tensor | None = None, work: Any = None) -> None:
        self._values, self._tensor, self._work = values, tensor, work

    def arrived(self) -> bool:
        """Whether :meth:`result` would return at once."""
        return self._work is None or self._work.is_completed()

    def result(self) -> list[float]:
        if self._work is not None:
            self._work.wait()
            self._values, self._work = self._tensor.tolist(), None  # type: ignore[union-attr]
        return self._values


def start_sum(values: list[float]) -> PendingSum:
    """Start summing a few float64 values over ranks (gloo, in the background); a world of one sums nothing.

    Every rank must start the same sums in the same order; reading a result needs no peer, so
    one rank may read early. Sums of one value are the value itself, bit for bit (float64)."""
    if not active() or dist.get_world_size() == 1:
        return PendingSum([float(v) for v in values])
    tensor = torch.tensor(values, dtype=torch.float64, device=CPU)
    return PendingSum(values, tensor, dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=_cpu_group, async_op=True))


class PendingRows:
    """Every rank's row of floats, gathered in the background: ``result()`` waits for them (usually done by then)."""

    def __init__(self, rows: list[list[float]], tensors: list[torch.Tensor] | None = None, work: Any = None) -> None:
        self._rows, self._tensors, self._work = rows, tensors, work

    def arrived(self) -> bool:
        """Whether :meth:`result` would return at once."""
        return self._work is None or self._work.is_completed()

    def result(self) -> list[list[float]]:
        """The rows in rank order."""
        if self._work is not None:
            self._work.wait()
            self._rows, self._tensors, self._work = [t.tolist() for t in self._tensors or []], None, None
        return self._rows


def start_gather(values: list[float]) -> PendingRows:
    """Start gathering every rank's float64 ``values`` (the same length on every rank; gloo, in the background).

    An all-gather, not an all-reduce: with gloo it costs about half the CPU of an all-reduce of the
    same few floats (fewer messages), and the caller sums the rows in rank order itself, so a sum
    does not depend on the collective's algorithm or on how many values travel together."""
    if not active() or dist.get_world_size() == 1:
        return PendingRows([[float(v) for v in values]])
    tensor = torch.tensor(values, dtype=torch.float64, device=CPU)
    rows = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    return PendingRows([], rows, dist.all_gather(rows, tensor, group=_cpu_group, async_op=True))
