"""Replicas that drift: in data-parallel jobs the replicated tensors must be bitwise equal on every rank.

DDP keeps gradients all-reduced, so one rank whose weights moved by one ulp
(silent data corruption on one device) stays apart forever and nothing fails.
At every save each rank digests its replica of the replicated tensors (plain
tensors, and DTensors whose placements are all ``Replicate``; shards are not
replicas): per tensor, the wrapping sum of its bits (the floats viewed as
integers of their width, summed in that width: the vectorised kernel), one
read pass on the device that holds them (cost against the stall: bench/finite_check.py).
Any single changed element changes its tensor's sum, and the sums of
different ranks travel with the save's agreement (:mod:`saver`). A tensor
whose digests differ names the ranks that disagree with the majority (with a
tie, those that disagree with rank 0, the writer of replicated tensors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

_AS_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _replicated(tensor: torch.Tensor) -> torch.Tensor | None:
    if isinstance(tensor, DTensor):
        return tensor.to_local() if all(isinstance(p, Replicate) for p in tensor.placements) else None
    return tensor


def digests(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """Each replicated floating tensor's bit sum (stable key order: the state dict's)."""
    keys, sums = [], []
    for key, tensor in tensors.items():
        local = _replicated(tensor)
        if local is None or not local.is_floating_point() or not local.numel() or local.element_size() not in _AS_INT:
            continue
        bits = local.detach().contiguous().view(_AS_INT[local.element_size()])
        keys.append(key)
        sums.append(bits.sum(dtype=bits.dtype).to(torch.int64))  # wrapping in its own width: the fast kernel
    if not sums:
        return {}
    return dict(zip(keys, torch.stack(sums).cpu().tolist()))


@dataclass(frozen=True)
class Divergence:
    tensor: str  # the first tensor (state-dict order) whose replicas differ
    ranks: tuple[int, ...]  # the ranks in the minority
    tensors: int  # how many tensors differ

    def describe(self) -> str:
        who = ", ".join(str(r) for r in self.ranks)
        return f"replicas diverged: rank(s) {who} differ in {self.tensor} ({self.tensors} tensor(s) differ)"


def compare(per_rank: list[dict[str, int]]) -> Divergence | None:
    """The first tensor whose digests differ across ranks, and who is in the minority."""
    if len(per_rank) < 2:
        return None
    differing: list[tuple[str, tuple[int, ...]]] = []
    for key in per_rank[0]:
        values = [digest.get(key) for digest in per_rank]
        if len(set(values)) > 1:
            differing.append((key, _minority(values)))
    if not differing:
        return None
    return Divergence(differing[0][0], differing[0][1], len(differing))


def _minority(values: list[Any]) -> tuple[int, ...]:
    counts = {value: values.count(value) for value in values}
    top = max(counts.values())
    leaders = [v for v, c in counts.items() if c == top]
    reference = values[0] if len(leaders) > 1 else leaders[0]  # a tie: rank 0's replica is the written one
    return tuple(rank for rank, value in enumerate(values) if value != reference)
