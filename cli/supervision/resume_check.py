"""Was the resume whole? The replayed steps' losses against the failed attempt's, and throughput after vs before.

The steps between the snapshot and the failure ran twice: once before the
crash and again after the restore, and the run dir holds both losses (each
record names its ``attempt``): rank 0's own loss, a line as each step ends
(``records.OWN_LOSSES``, marked ``own``), and the mean over ranks in
``metrics.jsonl``, written only once a batch of steps is shared, so a crash
usually takes the last batch's. Rank 0's own losses are compared when the
failed attempt left them (like with like: the same rank, the same batches);
a resume at another world size gives rank 0 other batches, so it is judged
on the means. In deterministic mode they must be equal
bit for bit — anything else means some state (an RNG, the data position, the
optimizer) was not restored: verdict ``exact`` or ``diverged``. A run
declared non-deterministic, or a resume at another world size (its per-rank
RNG was reseeded, its reductions run in another order), gets ``within tolerance`` (relative difference at
most 1e-3 in fp32, 2e-2 where the arithmetic is reduced precision: tf32,
bf16, fp16) or ``diverged``, with the largest relative difference.
Throughput compares steps 5–25 after the restart (the first steps warm up)
with the 20 steps before the failure. Everything here is pure and
table-tested. Importable without torch.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ckptrun.runtime.records import same_float

EXACT, WITHIN, DIVERGED = "exact", "within tolerance", "diverged"
TOLERANCE = {"fp32": 1e-3, "tf32": 2e-2, "bf16": 2e-2, "fp16": 2e-2}
DEFAULT_TOLERANCE = 1e-3
BEFORE_STEPS = 20  # steps before the failure whose rate is the baseline
AFTER_FIRST, AFTER_LAST = 5, 25  # steps after the restart whose rate is compared
MIN_INTERVALS = 5  # fewer step intervals than this: no rate
THROUGHPUT_FLAG = 0.2  # a ratio beyond 1 ± this is flagged


@dataclass(frozen=True)
class Verdict:
    verdict: str | None  # None: no replayed step seen yet
    max_rel_diff: float | None
    replayed_steps: int
    tolerance: float | None  # None: bitwise (deterministic)


def rel_diff(original: float, replayed: float) -> float:
    """|a − b| / |a| (0 for equal values, NaN included; inf when only one is NaN or a is 0 and b is not)."""
    if same_float(original, replayed):
        return 0.0
    if math.isnan(original) or math.isnan(replayed) or original == 0:
        return math.inf
    return abs(original - replayed) / abs(original)


def tolerance(precision: str | None) -> float:
    return TOLERANCE.get(precision or "", DEFAULT_TOLERANCE)


def resume_verdict(original: dict[int, float], replayed: dict[int, float], deterministic: bool,
                   precision: str | None) -> Verdict:
    """Compare the steps present in both; deterministic runs must match bitwise."""
    steps = sorted(set(original) & set(replayed))
    if not steps:
        return Verdict(None, None, 0, None if deterministic else tolerance(precision))
    worst = max(rel_diff(original[s], replayed[s]) for s in steps)
    if deterministic:
        same = all(same_float(original[s], replayed[s]) for s in steps)
        return Verdict(EXACT if same else DIVERGED, worst, len(steps), None)
    limit = tolerance(precision)
    return Verdict(WITHIN if worst <= limit else DIVERGED, worst, len(steps), limit)


def steps_per_second(times: list[float]) -> float | None:
    """Steps per second over consecutive step records' times (None when too few or no time passed)."""
    if len(times) < MIN_INTERVALS + 1 or times[-1] <= times[0]:
        return None
    return (len(times) - 1) / (times[-1] - times[0])


def throughput_ratio(before: list[float], after: list[float]) -> float | None:
    """Rate after the restart ÷ rate before the failure, from step record times."""
    rate_before, rate_after = steps_per_second(before), steps_per_second(after)
    return rate_after / rate_before if rate_before and rate_after else None


# --- what the supervisor keeps while it watches ---------------------------------------


@dataclass
class StepLog:
    """One attempt's step records, bounded: losses since the second-newest snapshot, the last step times."""

    losses: dict[int, float] = field(default_factory=dict)  # the mean over ranks (metrics.jsonl)
    own: dict[int, float] = field(default_factory=dict)  # rank 0's own (records.OWN_LOSSES)
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=BEFORE_STEPS + 1))
    snapshots: list[int] = field(default_factory=list)

    def add(self, record: dict[str, Any]) -> None:
        if isinstance(record.get("loss"), (int, float)) and "step" in record:
            (self.own if record.get("own") else self.losses)[int(record["step"])] = float(record["loss"])
        if isinstance(record.get("time"), (int, float)) and not record.get("own"):
            self.recent.append(float(record["time"]))

    def saved(self, step: int) -> None:
        """A snapshot of step ``step`` exists: a restart never replays from before the one preceding it."""
        if self.snapshots and self.snapshots[-1] == step:
            return
        self.snapshots = (self.snapshots + [step])[-2:]
        if len(self.snapshots) == 2:
            self.losses = {s: v for s, v in self.losses.items() if s > self.snapshots[0]}
            self.own = {s: v for s, v in self.own.items() if s > self.snapshots[0]}

    def after(self, step: int) -> dict[int, float]:
        return {s: v for s, v in self.losses.items() if s > step}

    def own_after(self, step: int) -> dict[int, float]:
        return {s: v for s, v in self.own.items() if s > step}


@dataclass
class ResumeWatch:
    """A restarted attempt, step by step: the replayed losses and the first steps' times."""

    original: dict[int, float]  # the failed attempt's mean losses after the snapshot step
    before: list[float]  # the failed attempt's last step times
    deterministic: bool
    own_original: dict[int, float] = field(default_factory=dict)  # its rank 0's own losses after the snapshot
    replayed: dict[int, float] = field(default_factory=dict)
    own_replayed: dict[int, float] = field(default_factory=dict)
    times: list[float] = field(default_factory=list)  # this attempt's first AFTER_LAST step times
    precision: str | None = None
    diverged_early: bool = False  # some replayed step already differs beyond what the mode allows
    resharded: bool = False  # restored at another world size: never judged bitwise, nor on rank 0's own losses

    @property
    def bitwise(self) -> bool:
        return self.deterministic and not self.resharded

    @property
    def by_own(self) -> bool:
        """Judged on rank 0's own losses: the failed attempt left them, and rank 0 runs the same batches."""
        return bool(self.own_original) and not self.resharded

    def _judged(self) -> tuple[dict[int, float], dict[int, float]]:
        return (self.own_original, self.own_replayed) if self.by_own else (self.original, self.replayed)

    @property
    def missing(self) -> set[int]:
        """Original steps (of the losses judged) not replayed yet."""
        original, replayed = self._judged()
        return set(original) - set(replayed)

    def add(self, record: dict[str, Any]) -> None:
        step, loss, own = record.get("step"), record.get("loss"), bool(record.get("own"))
        if isinstance(record.get("time"), (int, float)) and not own and len(self.times) < AFTER_LAST:
            self.times.append(float(record["time"]))
        if not own:
            self.precision = record.get("precision", self.precision)
        original, replayed = (self.own_original, self.own_replayed) if own else (self.original, self.replayed)
        if step is None or not isinstance(loss, (int, float)) or int(step) not in original:
            return
        replayed[int(step)] = float(loss)
        if own == self.by_own:
            one = resume_verdict({int(step): original[int(step)]}, {int(step): float(loss)}, self.bitwise, self.precision)
            self.diverged_early = self.diverged_early or one.verdict == DIVERGED

    def verdict(self) -> Verdict:
        return resume_verdict(*self._judged(), self.bitwise, self.precision)

    def decided(self) -> bool:
        """Every replayed step seen (or one already diverged)."""
        return self.diverged_early or not self.missing

    def state(self) -> str:
        """The verdict so far, cheaply (for the status line on every poll)."""
        if self.diverged_early:
            return DIVERGED
        if self.missing:
            return "checking"
        return EXACT if self.bitwise else WITHIN

    def settled(self) -> bool:
        """Verdict decided and the throughput window seen: the restart event can be written."""
        return self.decided() and len(self.times) >= AFTER_LAST

    def throughput(self) -> float | None:
        """After warm-up, over the whole window only: a restart followed by fewer than 25 steps (a small run's)
        is not judged; its few intervals, some still warming up, would flag almost every restart."""
        after = self.times[AFTER_FIRST - 1:AFTER_LAST]
        if len(after) < AFTER_LAST - AFTER_FIRST + 1:
            return None
        return throughput_ratio(self.before, after)

    def fields(self) -> dict[str, Any]:
        """The restart event's resume fields."""
        verdict = self.verdict()
        return {"resume_verdict": verdict.verdict, "resume_max_rel_diff": verdict.max_rel_diff,
                "replayed_steps": verdict.replayed_steps, "resume_tolerance": verdict.tolerance,
                "resume_compared": ("rank 0's own loss" if self.by_own else "mean loss") if verdict.verdict else None,
                "throughput_ratio": self.throughput()}


def flagged(ratio: float | None) -> bool:
    return ratio is not None and abs(ratio - 1) > THROUGHPUT_FLAG
