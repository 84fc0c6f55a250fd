"""The scenario matrix (issue 38): one value on each axis a feature meets, the cells that cannot apply, a cover.

A *cell* is one value of each axis below. Features break where they meet — the memory tier at two ranks per
node, a blow-up that comes back after a rollback, a first script with no DDP wrapper — so a feature is proven
when it passes in the cells users run, not in the one its own test picked. This module is pure (no torch, no
processes): the axes, the rules that make a combination not applicable (each with its reason, printed by the
harness, never skipped in silence), and :func:`cover`, the covering set ``make matrix`` runs: every pair of
applicable axis values in at least one cell, plus the triples users hit hardest. :mod:`matrix_cells` runs
one cell and judges it; ``bench/matrix.py`` runs a cover and writes ``bench/results/matrix.json``;
``tests/test_matrix.py`` checks the cover and runs a small sample chosen from the commit, so that
successive landings run different cells.

Adding an axis value: add its short name to the axis in ``AXES``; say in :func:`not_applicable` where it cannot
apply and why; teach :mod:`matrix_cells` how to set it up (``_state_job``, ``_tier_flags``, ``_run_fault``)
and what a user relies on it for (:func:`matrix_cells.expect`); then ``make matrix CELLS=...`` its new cells.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

AXES: dict[str, tuple[str, ...]] = {
    # nodes x ranks per node on one host (each node its own --local-addr, as real nodes have distinct addresses);
    # elastic-2to1: --nnodes 1:2, a node lost past the join timeout, the job goes on resharded on the other
    "topology": ("1x1", "1x2", "2x1", "2x2", "elastic-2to1"),
    # ddp: a DDP model; fsdp2: fully_shard; per-rank: run.track(..., per_rank=True) besides a DDP model;
    # unwrapped: a first script's bare nn.Linear; plain: a torchrun script that checkpoints itself;
    # lightning / hf: the framework's own loop and checkpoints with ckptrun.integrations
    "state": ("ddp", "fsdp2", "per-rank", "unwrapped", "plain", "lightning", "hf"),
    # local: a local checkpoint dir; s3: the moto server; memory: the memory tier over local;
    # memory-replica: the memory tier with one replica on the other node; cache-s3: S3 with --local-cache
    "tier": ("local", "s3", "memory", "memory-replica", "cache-s3"),
    "fault": ("none", "kill", "lose-node", "hang", "stop-resume", "corrupt", "one-off-blowup", "recurring-blowup",
              "poison", "disk-full", "supervisor-kill", "leader-loss"),
}
RUNTIME_STATES = ("ddp", "fsdp2", "per-rank", "unwrapped")  # snapshots by ckptrun.runtime: verified and exact
OWN_CHECKPOINTS = ("plain", "lightning", "hf")  # the script keeps its own checkpoints
STATE_FAULTS = ("one-off-blowup", "recurring-blowup", "poison")  # the runtime's checks of the values it trains
MANY_NODES = ("2x1", "2x2", "elastic-2to1")


@dataclass(frozen=True, order=True)
class Cell:
    topology: str
    state: str
    tier: str
    fault: str

    @property
    def name(self) -> str:
        return f"{self.topology}/{self.state}/{self.tier}/{self.fault}"

    def as_dict(self) -> dict[str, str]:
        return {"topology": self.topology, "state": self.state, "tier": self.tier, "fault": self.fault}

    @classmethod
    def parse(cls, text: str) -> Cell:
        """``2x2/fsdp2/memory-replica/lose-node`` (each part an axis value, in the axes' order)."""
        parts = text.strip().split("/")
        if len(parts) != len(AXES) or any(p not in values for p, values in zip(parts, AXES.values())):
            raise ValueError(f"cell {text!r}: write topology/state/tier/fault, each one of "
                             + "; ".join(f"{axis}: {', '.join(values)}" for axis, values in AXES.items()))
        return cls(*parts)


def not_applicable(cell: Cell) -> str | None:
    """Why this combination cannot apply (shown by the harness), or None when it is a cell to run."""
    t, s, tier, f = cell.topology, cell.state, cell.tier, cell.fault
    many = t in MANY_NODES
    rules = [
        (f in ("lose-node", "leader-loss") and not many, f"{f} needs more than one node"),
        (tier == "memory-replica" and not many, "a memory replica lives on another node: one node has none"),
        (t == "elastic-2to1" and f != "lose-node", "elastic-2to1 is the shrink itself: its fault is lose-node"),
        (t == "elastic-2to1" and s not in ("ddp", "fsdp2"),
         "only a snapshot of replicated or DCP-sharded state reshards (per-rank state and a script's own "
         "checkpoints stay with the world size that wrote them)"),
        (t == "elastic-2to1" and tier != "local", "the elastic cell reshards durable local snapshots"),
        (s == "unwrapped" and t.endswith("x1"), "one rank per node with no wrapper is one rank of a DDP-free job: "
         "the 'differs across ranks' rule needs two ranks on a node (1x2, 2x2)"),
        (s in OWN_CHECKPOINTS and tier != "local",
         "a script's own checkpoints go where the script writes them: ckptrun's tiers hold ckptrun snapshots"),
        (s in OWN_CHECKPOINTS and f in STATE_FAULTS,
         "the non-finite, rollback and poison checks watch ckptrun.runtime's loop, which the script does not use"),
        (s in OWN_CHECKPOINTS and f == "corrupt" and s == "plain",
         "a plain script's checkpoint has no manifest: there is nothing to verify it against"),
        (s in OWN_CHECKPOINTS and f == "disk-full", "the script's own save fails in the script: ckptrun's "
         "final-save rule is for its snapshots"),
        (tier in ("memory", "memory-replica") and f == "poison",
         "poison-after-restore names a durable step; a memory restore's step depends on the write in flight"),
    ]
    return next((reason for applies, reason in rules if applies), None)


def all_cells() -> list[Cell]:
    return [Cell(*values) for values in itertools.product(*AXES.values())]


def applicable() -> list[Cell]:
    return [cell for cell in all_cells() if not_applicable(cell) is None]


# The triples users hit hardest: each is in the cover whatever pairwise picks.
HARDEST = (
    Cell("2x2", "fsdp2", "memory-replica", "lose-node"),
    Cell("2x2", "ddp", "cache-s3", "kill"),
    Cell("1x2", "ddp", "local", "recurring-blowup"),
    Cell("2x2", "fsdp2", "memory", "recurring-blowup"),
    Cell("1x2", "unwrapped", "local", "kill"),
    Cell("2x2", "fsdp2", "memory", "kill"),
)

# What a cell costs here, roughly (seconds on 2 cores), so that the cover prefers cheap cells for the same pairs.
_TOPOLOGY_COST = {"1x1": 12, "1x2": 16, "2x1": 25, "2x2": 40, "elastic-2to1": 60}
_STATE_COST = {"ddp": 0, "fsdp2": 4, "per-rank": 0, "unwrapped": 0, "plain": 0, "lightning": 15, "hf": 20}
_FAULT_COST = {"none": 0, "kill": 6, "hang": 12, "stop-resume": 14, "corrupt": 16, "one-off-blowup": 2,
               "recurring-blowup": 2, "poison": 14, "disk-full": 2, "supervisor-kill": 16, "leader-loss": 18,
               "lose-node": 25}


def cost(cell: Cell) -> float:
    tier = 4 if cell.tier in ("s3", "cache-s3") else 0
    return _TOPOLOGY_COST[cell.topology] + _STATE_COST[cell.state] + _FAULT_COST[cell.fault] + tier


@functools.cache
def pairs_of(cell: Cell) -> frozenset[tuple[tuple[str, str], tuple[str, str]]]:
    items = list(cell.as_dict().items())
    return frozenset(itertools.combinations(items, 2))


@functools.cache
def coverable_pairs() -> frozenset[tuple[tuple[str, str], tuple[str, str]]]:
    """Every pair of axis values that some applicable cell holds (the others are n/a, each for a rule's reason)."""
    return frozenset().union(*(pairs_of(cell) for cell in applicable()))


def cover() -> list[Cell]:
    """A covering set: the hardest triples, then greedily the cell that covers most uncovered pairs per second
    of cost, until every coverable pair is in a cell. Deterministic: ties go to the earlier cell."""
    return list(_greedy_cover())


@functools.cache
def _greedy_cover() -> tuple[Cell, ...]:
    chosen = list(HARDEST)
    missing = set(coverable_pairs()) - set().union(*(pairs_of(cell) for cell in chosen))
    candidates = applicable()
    while missing:
        def gain(i: int) -> tuple[float, int]:
            return len(pairs_of(candidates[i]) & missing) / cost(candidates[i]), -i

        best = max(range(len(candidates)), key=gain)
        chosen.append(candidates[best])
        missing -= pairs_of(candidates[best])
    return tuple(chosen)


def uncoverable_pairs() -> dict[tuple[tuple[str, str], tuple[str, str]], str]:
    """Pairs of axis values no applicable cell holds, with the reason of the first cell that would have."""
    every = set().union(*(pairs_of(cell) for cell in all_cells()))
    left = every - coverable_pairs()
    reasons: dict[tuple[tuple[str, str], tuple[str, str]], str] = {}
    for cell in all_cells():
        for pair in pairs_of(cell) & left:
            reasons.setdefault(pair, not_applicable(cell) or "")
    return reasons


def sample(cells: list[Cell], seed: str, budget_s: float) -> list[Cell]:
    """A few cells of ``cells`` chosen from ``seed`` (the commit), within ``budget_s`` of estimated cost: each
    landing runs other cells, so that successive landings walk the whole cover."""
    import hashlib

    order = sorted(cells, key=lambda c: hashlib.sha256(f"{seed}:{c.name}".encode()).hexdigest())
    picked, spent = [], 0.0
    for cell in order:
        if spent + cost(cell) <= budget_s:
            picked.append(cell)
            spent += cost(cell)
    return picked
