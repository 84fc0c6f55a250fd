"""Thin wrappers over torch.distributed that degrade to no-ops in a single process."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def barrier(group: Any = None) -> None:
    if active():
        dist.barrier(group=group)


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """Rank ``src``'s object on every rank (ranks here are our own workers: pickling is trusted)."""
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    if not active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=group)
    return out


def new_group() -> Any:
    """A gloo group of all ranks for snapshot traffic, so a background save never
    interleaves its collectives with the training step's on the default group."""
    return dist.new_group(backend="gloo") if active() else None


def all_reduce_sum(values: list[float]) -> list[float]:
    """Sum a few float64 values over ranks in one collective (the per-step shared decisions)."""
    if not active():
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.tolist()
