"""What a training script imports: ``import ckptrun.runtime as ckr; run = ckr.init(config)``.

Names load lazily (PEP 562) so that the torch-free contract modules (env,
manifest, store, verify, records, faults) import without torch, which keeps
``ckptrun --help`` and ``ckptrun verify`` fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckptrun.runtime.step.data import DataLoader, ResumableSampler
    from ckptrun.runtime.env import RunEnv
    from ckptrun.runtime.step.session import Run
    from ckptrun.runtime.step.startup import init
    from ckptrun.runtime.checkpoint.plain_state import Value

__all__ = ["DataLoader", "ResumableSampler", "Run", "RunEnv", "Value", "init"]

_HOME = {
    "DataLoader": "ckptrun.runtime.step.data",
    "ResumableSampler": "ckptrun.runtime.step.data",
    "Run": "ckptrun.runtime.step.session",
    "RunEnv": "ckptrun.runtime.env",
    "Value": "ckptrun.runtime.checkpoint.plain_state",
    "init": "ckptrun.runtime.step.startup",
}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        value = getattr(importlib.import_module(_HOME[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ckptrun.runtime' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
