"""Hyperparameters on resume: what changed since the snapshot, and one way to apply a new learning rate.

A resumed run restores the optimizer and the scheduler, and with them the
*old* learning rate, which lives in three places: each param group's ``lr``,
its ``initial_lr`` (where a scheduler starts from) and the scheduler's
``base_lrs`` (what every schedule multiplies). A new rate must scale all three
by one factor, or the next ``scheduler.step()`` quietly brings the old one back;
scaling keeps per-group ratios and the schedule's position.
"""

from __future__ import annotations

from typing import Any


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{key: (snapshot's value, this run's value)}`` for every config key that differs."""
    return {k: (saved.get(k), current.get(k)) for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)}


def base_lr(optimizer: Any, scheduler: Any = None) -> float:
    """The rate a schedule scales: the scheduler's first base lr, else the first group's initial (or current) lr."""
    if scheduler is not None and getattr(scheduler, "base_lrs", None):
        return float(scheduler.base_lrs[0])
    group = optimizer.param_groups[0]
    return float(group.get("initial_lr", group["lr"]))


def scale_lr(optimizer: Any, scheduler: Any, factor: float) -> None:
    """Scale every group's ``lr`` and ``initial_lr`` and the scheduler's ``base_lrs`` (and last lr) by ``factor``."""
    for group in optimizer.param_groups:
        group["lr"] *= factor
        if "initial_lr" in group:
            group["initial_lr"] *= factor
    if scheduler is not None and hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
        if hasattr(scheduler, "_last_lr"):  # what get_last_lr() reports until the next step
            scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def set_lr(optimizer: Any, scheduler: Any, lr: float) -> None:
    """Make ``lr`` the base rate from now on (see the module docstring)."""
    base = base_lr(optimizer, scheduler)
    if base == 0:
        raise ValueError("set_lr scales the schedule by new/old base rate, and the old base rate is 0; "
                         "set param_group['lr'] (and the scheduler's base_lrs) yourself")
    if scheduler is not None and any(hasattr(scheduler, name) for name in ("max_lrs", "total_steps")) \
            and "max_lr" in optimizer.param_groups[0]:
        raise ValueError(f"set_lr cannot rescale {type(scheduler).__name__}: it keeps its own max_lr per group; "
                         "build the scheduler again with the new max_lr")
    scale_lr(optimizer, scheduler, lr / base)
