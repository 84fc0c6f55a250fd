"""Tracked objects as DCP ``Stateful`` state: one path for plain, DDP and FSDP2 models.

Modules and optimizers go through ``torch.distributed.checkpoint.state_dict``:
keys are the model's own parameter names (no ``module.`` of DDP, no
``_orig_mod.`` of torch.compile), optimizer state is keyed by those names
rather than by parameter index, and FSDP2 shards stay DTensors, so DCP writes
each rank's shards and reshards them on load. Every other tracked object
(scheduler, scaler, data loader) keeps its own ``state_dict``. Tensors that
share storage (tied weights) are stored once; the others name it as an alias.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.nn.parallel import DistributedDataParallel

from ckptrun.runtime.checkpoint.staging import local
from ckptrun.runtime.checkpoint.treecodec import join, split
from ckptrun.runtime.checkpoint.wrappers import canonical, unwrap


class ModuleState(Stateful):
    """A module's parameters and buffers under their canonical names; DTensor shards stay sharded."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = unwrap(module)

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.module)

    def targets(self) -> dict[str, Any]:
        return self.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.module, canonical(self.module, state_dict))


class OptimizerState(Stateful):
    """An optimizer's state keyed by parameter name (FQN), as ``get_optimizer_state_dict`` gives it."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = unwrap(model), optimizer

    def state_dict(self) -> dict[str, Any]:
        if not self.optimizer.state:  # before the first step torch would take a zero-lr step to create it
            return self._stateless()
        return get_optimizer_state_dict(self.model, self.optimizer)

    def targets(self) -> dict[str, Any]:
        """Like :meth:`state_dict`, creating the state first (a zero-lr step) so there is one to load into."""
        return get_optimizer_state_dict(self.model, self.optimizer)

    def _stateless(self) -> dict[str, Any]:
        names = {id(p): name for name, p in self.model.named_parameters()}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
                  for g in self.optimizer.param_groups]
        return {"state": {}, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups = state_dict.get("param_groups") or [{}]
        if any(isinstance(p, int) for p in groups[0].get("params", [])):  # a snapshot from before FQN keys
            self.optimizer.load_state_dict(state_dict)
        else:
            set_optimizer_state_dict(self.model, self.optimizer, state_dict)


def stateful(objects: dict[str, Any]) -> dict[str, Any]:
    """Each tracked object as it is saved: modules and (with a tracked ``model``) optimizers wrapped."""
    model = objects.get("model")
    out = {}
    for name, obj in objects.items():
        if isinstance(obj, torch.nn.Module):
            out[name] = ModuleState(obj)
        elif isinstance(obj, torch.optim.Optimizer) and isinstance(model, torch.nn.Module):
            out[name] = OptimizerState(model, obj)
        else:
            out[name] = unwrap(obj)
    return out


def collect(objects: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, str]]:
    """(json trees by object name, tensors to store, aliases): each tied tensor is stored under its first key."""
    trees, tensors = {}, {}
    for name, obj in stateful(objects).items():
        trees[name], own = split(obj.state_dict(), name)
        tensors.update(own)
    aliases = tied(tensors)
    return trees, {k: t for k, t in tensors.items() if k not in aliases}, aliases


def first_rank_keys(objects: dict[str, Any]) -> frozenset[str]:
    """Stored keys of the buffers of DDP models that sync buffers (``broadcast_buffers``, the default): between
    steps each rank holds its own update (BatchNorm's running statistics from its own batch) and the next
    forward replaces them with rank 0's, so rank 0's copy is the state and must be the one saved."""
    keys: set[str] = set()
    for name, obj in objects.items():
        ddp = _ddp_in(obj)
        if ddp is not None and ddp.will_sync_module_buffers():
            keys.update(f"{name}.{buffer}" for buffer, _ in unwrap(obj).named_buffers())
    return frozenset(keys)


def _ddp_in(obj: Any) -> DistributedDataParallel | None:
    """The DDP wrapper of ``obj``, also under ``torch.compile`` (``torch.compile(DDP(model))``: its ``_orig_mod``)."""
    while isinstance(obj, torch.nn.Module):
        if isinstance(obj, DistributedDataParallel):
            return obj
        obj = getattr(obj, "_orig_mod", None)
    return None


def tied(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """``{alias: key}`` for tensors that are views of the same bytes as an earlier key's."""
    seen: dict[tuple, str] = {}
    aliases = {}
    for key, tensor in tensors.items():
        shard = local(tensor)
        if shard.numel() == 0 or shard.device.type == "meta":
            continue
        identity = (shard.untyped_storage().data_ptr(), shard.storage_offset(), tuple(shard.shape), shard.stride(), shard.dtype)
        if identity in seen:
            aliases[key] = seen[identity]
        else:
            seen[identity] = key
    return aliases


def live_tensors(objects: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The live model and optimizer tensors, keyed as stored: DCP loads into them in place, so an FSDP2
    rank receives only its own shards, on its own device."""
    tensors: dict[str, torch.Tensor] = {}
    for name, obj in stateful(objects).items():
        if isinstance(obj, (ModuleState, OptimizerState)):
            tensors.update(split(obj.targets(), name)[1])
    return tensors


def apply(objects: dict[str, Any], trees: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Load each tracked object's stored state (the caller checked that ``trees`` has every name)."""
    for name, obj in stateful(objects).items():
        obj.load_state_dict(join(trees[name], tensors))
