"""The model inside its wrappers (DDP, ``torch.compile``), so that snapshot keys name the model itself.

A compiled model's ``state_dict`` keys carry ``_orig_mod.`` and a DDP model's
would carry ``module.``; both depend on how an attempt runs, not on what is
trained. Snapshots store the unwrapped module's keys, so switching compile or
DDP on or off between attempts resumes. Optimizer state is keyed by the same
parameter names (``runtime/checkpoint/train_state.py``).
"""

from __future__ import annotations

from typing import Any

import torch

COMPILE_PREFIX = "_orig_mod."  # torch.compile's OptimizedModule keeps the model as ``_orig_mod``


def unwrap(obj: Any) -> Any:
    """The module inside any nesting of DDP and torch.compile (any other object as it is)."""
    while True:
        if isinstance(obj, torch.nn.parallel.DistributedDataParallel):
            obj = obj.module
        elif isinstance(obj, torch.nn.Module) and isinstance(getattr(obj, "_orig_mod", None), torch.nn.Module):
            obj = obj._orig_mod
        else:
            return obj


def canonical(obj: Any, state: Any) -> Any:
    """A module's state as its unwrapped self names it: strips ``_orig_mod.`` left by snapshots of older ckptrun."""
    if not isinstance(obj, torch.nn.Module) or not isinstance(state, dict):
        return state
    return {key.replace(COMPILE_PREFIX, "") if isinstance(key, str) else key: value for key, value in state.items()}
