"""The arithmetic of recovery: RTO, cost per failure, goodput, and the checkpoint interval (Young, Daly).

Symbols, all in seconds:

* ``tau`` (τ) — training time between two saves (the save interval);
* ``delta`` (δ) — what a save costs the training loop (the stall; for a
  synchronous save, the whole save);
* ``w`` — background persist time of an asynchronous save: a snapshot becomes
  usable w after its stall ends (0 for synchronous saves);
* ``rto`` — detect + teardown + verify + backoff + restart: failure to the
  first step after restore;
* ``mtbf`` (M) — mean time between failures of the whole job.

A failure lands, on average, half way through an interval: it costs the RTO
plus (τ+δ)/2 of work done since the last usable snapshot plus w. Goodput is
the share of wall time that advances training: τ/(τ+δ) of each interval is
training, and each failure (one per M on average) throws away its cost.
Daly's interval (J. T. Daly, 2006, first-order form) minimises that waste;
Young's (1974) √(2δM) is its leading term. Everything here is pure and
table-tested (tests/test_rto_math.py). Importable without torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ckptrun.runtime.checkpoint.policies import daly  # noqa: F401 - one formula: the runtime's auto cadence and estimate-rto

# where a component's value comes from, most trustworthy first
MEASURED, HISTORY, ESTIMATED, CONFIGURED, ASSUMED, UNKNOWN = (
    "measured", "history", "estimated", "configured", "assumed", "unknown")
RTO_PARTS = ("detect", "teardown", "verify", "backoff", "restart")


def young(delta: float, mtbf: float) -> float:
    """Young's checkpoint interval √(2δM)."""
    return math.sqrt(2 * delta * mtbf)


def lost_work(tau: float, w: float = 0.0) -> tuple[float, float]:
    """Wall time of training redone after a failure: (expected τ/2 + w, worst τ + w)."""
    return tau / 2 + w, tau + w


def cost_per_failure(rto: float, tau: float, delta: float, w: float = 0.0) -> float:
    """Expected wall time one failure costs: RTO + (τ + δ)/2 + w."""
    return rto + (tau + delta) / 2 + w


def max_interval(budget: float, rto: float, delta: float, w: float = 0.0) -> float:
    """The longest τ whose expected cost per failure fits ``budget``: RTO + (τ+δ)/2 + w ≤ B ⇔ τ ≤ 2(B − RTO − w) − δ."""
    return 2 * (budget - rto - w) - delta


def goodput(tau: float, delta: float, w: float, rto: float, mtbf: float) -> float:
    """G = τ/(τ+δ) · (1 − (RTO + (τ+δ)/2 + w)/M), floored at 0 (failures faster than recovery)."""
    if tau + delta <= 0:
        return 0.0
    return max(0.0, tau / (tau + delta) * (1 - cost_per_failure(rto, tau, delta, w) / mtbf))


# --- components and the budget ---------------------------------------------------


@dataclass
class Component:
    """One part of the estimate: its value, where the value comes from, and how it was got."""

    name: str
    value_s: float | None
    source: str
    detail: str
    facts: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"value_s": self.value_s, "source": self.source, "detail": self.detail, **self.facts}


def total(components: dict[str, Component], names: tuple[str, ...] = RTO_PARTS) -> float | None:
    """Sum of the named components; None when any of them is unknown."""
    values = [components[name].value_s for name in names if name in components]
    return None if any(v is None for v in values) else float(sum(values))  # type: ignore[arg-type]


@dataclass(frozen=True)
class BudgetVerdict:
    """The figure compared with the budget, whether it fits, and the largest part of it."""

    limit_s: float
    figure_s: float
    ok: bool
    largest: str
    largest_s: float


def budget_verdict(parts: dict[str, float], limit_s: float) -> BudgetVerdict:
    """Compare the sum of ``parts`` with ``limit_s``; name the largest part (the one to cut first)."""
    figure = sum(parts.values())
    largest = max(parts, key=lambda name: parts[name])
    return BudgetVerdict(limit_s, figure, figure <= limit_s, largest, parts[largest])
