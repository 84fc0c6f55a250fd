"""Which tensors this rank writes, from DCP's save plan, planned again only when the state's layout changes.

Planning is collective (every rank's local plan is gathered, then replicated
tensors are de-duplicated, :func:`dcp_io.owned_keys`) and costs Python work per
tensor on every save. The plan depends only on the layout: keys, global shapes,
dtypes and, for a DTensor, its placements and this rank's shard. So each rank
digests its layout, the digests are gathered (one small collective), and the
cached keys are reused only when *every* rank's digest equals the one it had at
the last plan — the gathered list is the same on every rank, so all ranks reach
the same verdict and none is left waiting in a collective the others skip.
In a world of one the rank writes every tensor: no plan, no collective.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ckptrun.runtime import collectives
from ckptrun.runtime.checkpoint.dcp_io import owned_keys


def layout_digest(tensors: dict[str, torch.Tensor]) -> str:
    """A digest of everything DCP's save plan reads from ``tensors``."""
    lines = [f"{key}|{tuple(t.shape)}|{t.dtype}|{_shard(t)}" for key, t in sorted(tensors.items())]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _shard(tensor: torch.Tensor) -> str:
    if not isinstance(tensor, DTensor):
        return ""
    mesh = tensor.device_mesh
    return f"{tensor.placements}|{mesh.mesh.tolist()}|{mesh.get_coordinate()}|{tuple(tensor.to_local().shape)}"


class OwnedKeys:
    """This rank's share of the state under DCP's plan, cached across saves of an unchanged layout."""

    def __init__(self) -> None:
        self._digests: list[str] | None = None
        self._keys: set[str] = set()
        self.plans_made = 0  # how often the collective planner ran (the rest were cache hits)

    def __call__(self, tensors: dict[str, torch.Tensor], group: Any = None,
                 first_rank: frozenset[str] = frozenset()) -> set[str]:
        """Collective on ``group`` (except in a world of one): every rank calls it at the same save.
        ``first_rank``: keys only rank 0 writes (see :func:`dcp_io.owned_keys`)."""
        if collectives.world_size(group) == 1:
            return set(tensors)
        digests = collectives.all_gather_object(layout_digest(tensors) + "|" + ",".join(sorted(first_rank)), group=group)
        if digests != self._digests:
            self._keys = owned_keys(tensors, group, first_rank)
            self._digests = digests
            self.plans_made += 1
        return set(self._keys)
