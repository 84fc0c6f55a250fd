"""What a snapshot is made of: the names of its files, and the records its save and load exchange.

The vocabulary of :mod:`snapshot` (which holds the mechanism: persist, publish,
load), kept apart so each module is one concept. :mod:`snapshot` re-exports
every name here, so callers keep writing ``snapshot.State``. The manifest
itself (contract C2) is :mod:`ckptrun.runtime.manifest`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ckptrun.runtime.manifest import Manifest

DCP_DIR = "dcp"
STATE_JSON = "state.json"


def rank_json(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def rank_tensors(rank: int, legacy: bool = False) -> str:
    """A rank's own tensors (RNG states): raw tensor bytes, or ``torch.save`` in snapshots written before."""
    return f"rank-{rank:05d}.pt" if legacy else f"rank-{rank:05d}.safetensors"


class _Legacy:
    """Whether saves in this process write the format before raw tensors (``torch.save`` items, a pickled
    ``.metadata``): never in a run; tests switch it on to make older snapshots and prove they still load."""

    on = False


LEGACY = _Legacy()


@dataclass
class State:
    """What one rank contributes to a snapshot.

    ``shared_*`` is identical on every rank (model, optimizer, scheduler, config,
    counters); ``rank_*`` is this rank's own (RNG states).
    """

    shared_tree: dict[str, Any]
    shared_tensors: dict[str, torch.Tensor]
    rank_tree: dict[str, Any]
    rank_tensors: dict[str, torch.Tensor]
    staged_bytes: int = 0  # host buffer bytes holding this rank's share of ``shared_tensors``
    first_rank_keys: frozenset[str] = frozenset()  # of ``shared_tensors``: only rank 0's copy is right (DDP buffers)
    allocated_bytes: int = 0  # of which newly allocated by this save


@dataclass
class SnapshotInfo:
    """Manifest fields the caller knows and the store does not."""

    run_id: str
    lineage: str
    parent: str | None
    step: int
    epoch: int
    samples_seen: int
    precision: str
    config: dict[str, Any]
    code_version: str
    world_size_history: list[dict[str, int]] = field(default_factory=list)  # see reshard.history


@dataclass(frozen=True)
class SaveResult:
    """One save's outcome, the same on every rank."""

    ok: bool
    step: int = -1
    path: Path | None = None
    bytes: int = 0
    stall_s: float = 0.0  # what the training loop waited: previous save + preflight + stage
    persist_s: float = 0.0
    publish_s: float = 0.0
    error: str | None = None
    skipped: bool = False  # refused before writing (preflight, overlap policy)
    waited_s: float = 0.0  # part of the stall spent waiting for the previous save
    asynchronous: bool = False
    staging_allocated_bytes: int = 0  # new host buffers this save needed (0 once they exist)
    rss_after_stage_bytes: int = 0  # the process's resident memory right after staging
    staged_bytes_per_rank: tuple[int, ...] = ()  # each rank's staging buffers for this save: its share of the state
    allocated_bytes_per_rank: tuple[int, ...] = ()
    tensor_digest: str = ""  # one digest over every DCP data file: equal at two steps means nothing changed
    stale_of: int | None = None  # an earlier step whose tensor bytes this save repeats exactly (stale staging?)
    remote: str | None = None  # the object-store prefix it was committed to (runtime.remote_publish)
    upload_s: float = 0.0  # uploading and committing it there
    refused: str | None = None  # not published for its values ("non-finite", "replicas-diverged"), not its bytes
    diverged: tuple[str, tuple[int, ...]] | None = None  # replicas-diverged: the first tensor, the minority ranks


FaultHook = Callable[[str], None]


class LoadError(Exception):
    """A snapshot does not load (raised on every rank alike): restore falls back to an older one, unless it
    is the one C1 named for this attempt, which then fails."""


@dataclass
class Loaded:
    manifest: Manifest
    shared_tree: dict[str, Any]
    shared_tensors: dict[str, torch.Tensor]
    rank_tree: dict[str, Any]
    rank_tensors: dict[str, torch.Tensor]
