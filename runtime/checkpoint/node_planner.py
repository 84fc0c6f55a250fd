"""The save planner of a node's own snapshot: its ranks' shards are a part of each tensor, on purpose.

A memory-tier snapshot is saved by one node's ranks over a subgroup
(:func:`collectives.node_group`). With sharded state (FSDP2) those ranks hold
only some chunks of every parameter and moment, so DCP's default planner,
which checks that the group's plans fill every tensor, refuses each save
("Failed to validate global plan … invalid fill"). :class:`NodeShardPlanner`
keeps DCP's planning (de-duplication of replicated tensors, one global
metadata) and checks what must hold for a part: every chunk inside its
tensor, no two chunks overlapping. The other nodes' chunks live in their own
snapshots of the same step; a restore on the same topology reads each rank's
own chunks, and a lost node's come from a replica (:mod:`replication`).
"""

from __future__ import annotations

import dataclasses
from collections import ChainMap
from itertools import combinations
from typing import Any

from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, create_default_global_save_plan
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, ChunkStorageMetadata, Metadata
from torch.distributed.checkpoint.planner import SavePlan


def misplaced_chunks(metadata: Metadata) -> list[str]:
    """What is wrong with a part's chunks: one out of its tensor's bounds, or two that overlap."""
    problems = []
    for key, value in metadata.state_dict_metadata.items():
        if isinstance(value, BytesStorageMetadata) or len(value.size) == 0:
            continue
        problems += [f"{key}: chunk at {list(c.offsets)} of {list(c.sizes)} is outside {list(value.size)}"
                     for c in value.chunks if not _inside(c, value.size)]
        problems += [f"{key}: chunks at {list(a.offsets)} and {list(b.offsets)} overlap"
                     for a, b in combinations(value.chunks, 2) if _overlap(a, b)]
    return problems


def _inside(chunk: ChunkStorageMetadata, size: Any) -> bool:
    return all(0 <= o and o + s <= d for o, s, d in zip(chunk.offsets, chunk.sizes, size))


def _overlap(a: ChunkStorageMetadata, b: ChunkStorageMetadata) -> bool:
    return all(oa < ob + sb and ob < oa + sa for oa, sa, ob, sb in zip(a.offsets, a.sizes, b.offsets, b.sizes))


class NodeShardPlanner(DefaultSavePlanner):
    """DCP's default save planning, with the part-of-a-tensor check above in place of the whole-tensor one."""

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        plans = dedup_save_plans(all_plans, getattr(self, "dedup_save_to_lowest_rank", False))
        global_plan, metadata = create_default_global_save_plan(plans)
        if self.flatten_state_dict:  # the key mappings every rank's plan carries, as the default planner merges them
            merged = dict(ChainMap(*[plan.planner_data for plan in global_plan]))
            metadata = dataclasses.replace(metadata, planner_data=merged)
        if problems := misplaced_chunks(metadata):
            raise ValueError(f"the node's save plan is inconsistent: {'; '.join(problems[:3])}")
        self.global_plan, self.metadata = global_plan, metadata
        return global_plan, metadata
