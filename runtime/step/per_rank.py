"""State that differs from rank to rank, and the check that nothing else does.

A tracked object's tensors go to the snapshot's shared part: DCP stores a replicated tensor once (the copy
of the rank its de-duplication picks), which is right for DDP replicas and wrong for anything a rank holds
for itself — a prefetched batch came back as rank 1's inputs with rank 0's targets. So:

- ``run.track(name=obj, per_rank=True)`` stores ``obj`` once per rank, in that rank's own files beside its
  RNG state (``rank-R.json`` / ``rank-R.pt``), and restores each rank its own (same world size only: at
  another world size there is no rank to take it from, and the object keeps its fresh state).
- A model whose tensors differ across ranks when it is tracked (no shared seed, no DDP to broadcast rank 0's
  weights: a first script) is per-rank state by what it is: :func:`differing_models` finds it in one small
  gather at ``track``, and the run says so in one note (``per_rank=True`` says it explicitly). The
  optimizer of its parameters goes with it.
- A replicated model whose replicas drift later with no wrapper that synchronises gradients (DDP, FSDP) is
  refused naming that cause (:func:`synchronised`): a restart would drift the same way.
- Without it, at the first save each shared object that is not a model or optimizer (those are replicas or
  FSDP shards by construction) is hashed on every rank; when the digests differ the save is refused with one
  line naming the object and the fix. One ``all_gather_object`` of a few digests, once per process.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist

from ckptrun.runtime import collectives
from ckptrun.runtime.checkpoint.treecodec import join, split

PREFIX = "per_rank"


def capture(objects: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(json trees by name, tensors) of this rank's per-rank objects, keyed apart from the RNG tensors."""
    trees, tensors = {}, {}
    for name, obj in objects.items():
        trees[name], own = split(obj.state_dict(), f"{PREFIX}.{name}")
        tensors.update(own)
    return trees, tensors


def restore(objects: dict[str, Any], rank_tree: dict[str, Any], rank_tensors: dict[str, torch.Tensor]) -> list[str]:
    """Load each per-rank object's own state; returns the names the snapshot has no state for."""
    stored = rank_tree.get(PREFIX, {})
    missing = [name for name in objects if name not in stored]
    for name, obj in objects.items():
        if name in stored:
            obj.load_state_dict(join(stored[name], rank_tensors))
    return missing


def _digest(state: Any) -> str | None:
    """sha256 of the tensors in ``state`` (None when it holds none)."""
    _, tensors = split(state, "")
    if not tensors:
        return None
    hasher = hashlib.sha256()
    for key in sorted(tensors):
        tensor = tensors[key].detach()
        if tensor.device.type == "meta" or getattr(tensor, "is_sparse", False) or type(tensor) is not torch.Tensor:
            continue
        hasher.update(key.encode())
        hasher.update(tensor.cpu().contiguous().view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return hasher.hexdigest()


def divergent(objects: dict[str, Any]) -> list[str]:
    """Names of shared objects (not modules or optimizers) whose tensors differ across ranks. Collective."""
    if not collectives.active() or collectives.world_size() == 1:
        return []
    candidates = {name: obj for name, obj in objects.items()
                  if not isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)) and name != "scaler"}
    mine = {name: _digest(obj.state_dict()) for name, obj in sorted(candidates.items())}
    everyone: list[Any] = [None] * collectives.world_size()
    dist.all_gather_object(everyone, mine)
    return [name for name in mine if len({str(digests.get(name)) for digests in everyone}) > 1]


def trained_modules(objects: dict[str, Any]) -> dict[str, Any]:
    """The modules in ``objects`` whose parameters a tracked optimizer steps (an EMA's are not: it follows)."""
    stepped = {id(p) for obj in objects.values() if isinstance(obj, torch.optim.Optimizer)
               for group in obj.param_groups for p in group["params"]}
    return {name: obj for name, obj in objects.items()
            if isinstance(obj, torch.nn.Module) and any(id(p) in stepped for p in obj.parameters())}


def differing_models(modules: dict[str, Any]) -> list[str]:
    """Names of ``modules`` whose replicated parameters differ across ranks now. Collective (every rank, alike)."""
    from ckptrun.runtime.checkpoint.replicas import digests

    if not modules or not collectives.active() or collectives.world_size() == 1:
        return []
    # parameters only: buffers (BatchNorm's running stats) may differ across ranks by design, even under DDP
    mine = {name: digests(dict(module.named_parameters())) for name, module in sorted(modules.items())}
    everyone = collectives.all_gather_object(mine)
    return [name for name in mine if any(theirs.get(name) != mine[name] for theirs in everyone)]


def optimizers_of(objects: dict[str, Any], modules: list[Any]) -> list[str]:
    """Names of the optimizers in ``objects`` that step parameters of ``modules``."""
    owned = {id(p) for module in modules for p in module.parameters()}
    return [name for name, obj in objects.items() if isinstance(obj, torch.optim.Optimizer)
            and any(id(p) in owned for group in obj.param_groups for p in group["params"])]


def synchronised(module: Any) -> bool:
    """Whether something keeps ``module``'s replicas equal: DDP, FSDP (1 or 2), or DTensor parameters."""
    from torch.distributed.tensor import DTensor

    kinds = {cls.__name__ for cls in type(module).__mro__}
    return bool(kinds & {"DistributedDataParallel", "FullyShardedDataParallel", "FSDPModule"}) or \
        any(isinstance(p, DTensor) for p in module.parameters())


def per_rank_note(models: list[str], with_them: list[str]) -> str:
    listed, also = " and ".join(models), "".join(f" and its {name}" for name in with_them)
    return (f"note: {listed} {'differs' if len(models) == 1 else 'differ'} across ranks when tracked (each rank "
            f"built its own): kept as per-rank state{also}, one copy per rank; say so with "
            f"run.track(..., per_rank=True), or seed the ranks alike and wrap it in DDP to train one model")


def unsynchronised_refusal(error: str, step: int) -> str:
    return (f"{error} at step {step}: no tracked model is wrapped in DistributedDataParallel or FSDP, so nothing "
            "synchronises the gradients across ranks and each rank trains its own copy; wrap it "
            "(model = DDP(model)), or track it with per_rank=True")


def refusal(names: list[str]) -> str:
    listed = ", ".join(f"track({name}=...)" for name in names)
    return (f"{listed}: its tensors differ across ranks, and a shared snapshot would keep one rank's copy for all; "
            f"pass per_rank=True to store one per rank (run.track({names[0]}=..., per_rank=True)), or draw the "
            "batch inside the step instead of prefetching it across the step boundary")
