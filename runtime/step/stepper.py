"""One optimizer step under the precision policy: accumulate, unscale, clip, step, update.

The order is the one mixed-precision training needs: scaled backward per
micro-batch (DDP synchronises only the last), unscale once, clip on the
pre-clip global norm, optimizer step through the scaler, scaler update.
A skipped fp16 step is agreed by all ranks: the non-finite flag is all-reduced
because one rank's gradients may hold an inf the others do not.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ckptrun.runtime import collectives
from ckptrun.runtime.checkpoint.staging import local
from ckptrun.runtime.step.precision import Policy, to_float


@dataclass
class StepStats:
    loss: float
    grad_norm: float | None
    clipped: bool
    loss_scale: float | None
    skipped: bool
    zero_grad_fraction: float | None

    def metrics(self) -> dict[str, Any]:
        out = {"grad_norm": self.grad_norm, "clipped": self.clipped, "skipped": self.skipped}
        if self.zero_grad_fraction is not None:
            out["zero_grad_fraction"] = self.zero_grad_fraction
        if self.loss_scale is not None:
            out["loss_scale"] = self.loss_scale
        return out


def accumulate(model: Any, micro_batches: Sequence[Any], forward: Callable[[Any], Any],
               loss: Callable[[Any, Any], torch.Tensor] | None, policy: Policy,
               scaler: torch.amp.GradScaler | None, before_micro: Callable[[int], None],
               measure: Callable[[Any, Any], dict[str, Any]] | None = None) -> tuple[float, dict[str, float]]:
    """Forward under autocast, loss in fp32 outside it, scaled backward.

    Returns the mean loss and the mean of ``measure(outputs, batch)`` (custom metrics, no grad)."""
    count, total, custom = len(micro_batches), 0.0, {}
    for index, batch in enumerate(micro_batches):
        before_micro(index)
        syncing = index == count - 1 or not hasattr(model, "no_sync")
        with contextlib.nullcontext() if syncing else model.no_sync():
            with policy.autocast():
                output = forward(batch)
            value = (to_float(output) if loss is None else loss(to_float(output), batch)).float()
            if measure is not None:
                with torch.no_grad():
                    for key, metric in measure(to_float(output), batch).items():
                        custom[key] = custom.get(key, 0.0) + float(metric) / count
            scaled = value / count
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
        total += float(value.detach())
    return total / count, custom


def optimizer_step(model: Any, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None,
                   max_norm: float | None, count_zeros: bool = True) -> StepStats:
    """Unscale, clip, step and update; reports the pre-clip norm and whether the step was skipped.

    ``count_zeros`` measures the fraction of exactly-zero gradients (an underflow
    signal, worth its cost under mixed precision only)."""
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    if scaler is not None:
        scaler.unscale_(optimizer)
        _agree_on_inf(scaler, optimizer)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(parameters, max_norm)) if max_norm is not None else None
    zero_fraction = _zero_fraction(parameters) if count_zeros else None
    scale = None
    skipped = False
    if scaler is not None:
        scale = float(scaler.get_scale())
        scaler.step(optimizer)
        scaler.update()
        skipped = float(scaler.get_scale()) < scale
    else:
        optimizer.step()
    clipped = grad_norm is not None and max_norm is not None and grad_norm > max_norm
    return StepStats(0.0, grad_norm, clipped, scale, skipped, zero_fraction)


def _agree_on_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
    """Make every rank skip when any rank found an inf (private GradScaler state, stable since torch 1.6).

    The flags live on the device; their sum crosses ranks as a CPU tensor (gloo), as every decision does."""
    found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    local = sum(float(flag.item()) for flag in found.values())
    if collectives.all_reduce_sum([local])[0] > 0:
        for flag in found.values():
            flag.fill_(1.0)


def zero_count_due(step: int, every: int) -> bool:
    """Whether the step after ``step`` counts zero gradients: once per ``every`` steps (the decision cadence,
    the same on every rank, so the counting collective is too)."""
    return (step + 1) % max(1, every) == 0


def _zero_fraction(parameters: list[torch.Tensor]) -> float:
    """Fraction of exactly-zero gradient elements over all ranks: a cheap underflow signal.

    Counted on each rank's own elements (a DTensor gradient's local shard: FSDP2 holds a shard, and its
    ``numel()`` is the global size), in one device tensor read once, then summed over ranks in one
    reduction (replicated DDP gradients count on every rank alike: the fraction is the same). A rank without
    gradients still joins the reduction: the others wait in it."""
    grads = [local(p.grad) for p in parameters if p.grad is not None]
    nonzero = int(torch.stack([torch.count_nonzero(g) for g in grads]).sum()) if any(g.numel() for g in grads) else 0
    total = sum(g.numel() for g in grads)
    nonzero_all, total_all = collectives.all_reduce_sum([float(nonzero), float(total)])
    return 1.0 - nonzero_all / total_all if total_all else 0.0
