"""Issue 6's goals as ratios of figures measured in the same run, each with PASS or MISS.

A ratio is median ÷ median of the two figures (both from interleaved repeats
of the same run); a goal with no baseline compares the median itself. A goal
whose figures are missing or failed is reported as "n/a" with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common import Figure


@dataclass(frozen=True)
class Goal:
    text: str
    key: str
    baseline: str | None
    limit: float
    at_least: bool = False  # the ratio must be >= limit (throughputs) instead of <= limit

    def evaluate(self, figures: dict[str, Figure]) -> dict[str, Any] | None:
        needed = [self.key] + ([self.baseline] if self.baseline else [])
        if any(key not in figures for key in needed):
            return None
        broken = [key for key in needed if figures[key].error or not figures[key].samples]
        if broken:
            return {"goal": self.text, "ratio": None, "limit": self.limit, "verdict": "n/a",
                    "detail": f"{broken[0]}: {figures[broken[0]].error}"}
        ratio = figures[self.key].median / (figures[self.baseline].median if self.baseline else 1.0)
        ok = ratio >= self.limit if self.at_least else ratio <= self.limit
        off = ratio / self.limit - 1 if self.limit else ratio
        detail = "" if ok else (f"{-off:.0%} short" if self.at_least else f"{off:.0%} over the limit")
        return {"goal": self.text, "ratio": ratio, "limit": self.limit, "verdict": "PASS" if ok else "MISS", "detail": detail}


GOALS = [
    Goal("save_stall_s <= 1.5 x staging_floor_s", "save_stall_s", "staging_floor_s", 1.5),
    Goal("save_stall_s <= 0.5 x dcp_async_block_s", "save_stall_s", "dcp_async_block_s", 0.5),
    Goal("save_total_s <= 1.1 x torch_save_s (ckptrun hashes too)", "save_total_s", "torch_save_s", 1.1),
    Goal("train_slowdown_during_persist <= 1.3", "train_slowdown_during_persist", None, 1.3),
    Goal("persist_s <= 2 x save_total_s", "persist_s", "save_total_s", 2.0),
    Goal("restore_s <= 1.3 x torch_load_s (sha256, evicted)", "restore_s", "torch_load_s", 1.3),
    Goal("restore_cached_s <= 1.3 x torch_load_cached_s (sha256, page-cached)", "restore_cached_s", "torch_load_cached_s", 1.3),
    Goal("restore_blake3_s <= 1.3 x torch_load_s (blake3, evicted)", "restore_blake3_s", "torch_load_s", 1.3),
    Goal("verify_gbps >= 1.2 x sha256_1t_gbps (page-cached, 2-rank snapshot)", "verify_gbps", "sha256_1t_gbps", 1.2, at_least=True),
    Goal("runtime_overhead <= 0.01", "runtime_overhead", None, 0.01),
    Goal("template A/B (with / without runtime) <= 1.02", "template_ab_ratio", None, 1.02),
    Goal("help_s <= 0.2 s", "help_s", None, 0.2),
    Goal("ckptrun --help imports no torch", "help_imports_torch", None, 0.0),
]


def evaluate(figures: dict[str, Figure]) -> list[dict[str, Any]]:
    """Verdicts for the goals whose figures this set has."""
    return [verdict for goal in GOALS if (verdict := goal.evaluate(figures)) is not None]
