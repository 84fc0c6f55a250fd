"""What ``ckptrun report`` draws and tabulates: a run's records as per-attempt step series and a summary.

Everything is read from the run directory's records (contract C3) through
:mod:`ckptrun.runtime.records`; the picture is
:mod:`ckptrun.cli.commands.report_figure`'s, the page
:mod:`ckptrun.cli.commands.report_page`'s. Importable without torch or matplotlib.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptrun.cli.commands.status_facts import read_spec, run_state, step_budget
from ckptrun.cli.supervision.rundir import RunPaths, holder
from ckptrun.runtime import records
from ckptrun.runtime.records import same_float

RTO_SEGMENTS = (("detect_s", "detect"), ("teardown_s", "teardown"), ("verify_s", "verify"), ("backoff_s", "backoff"),
                ("startup_s", "start-up"), ("restore_s", "restore"), ("first_step_s", "first step"))


@dataclass
class RunFacts:
    """The run's records, and its per-attempt step series: {attempt: {step: metrics record}}."""

    run_dir: Path
    spec: Any
    run_id: str | None
    events: list[dict[str, Any]]
    series: dict[int, dict[int, dict[str, Any]]] = field(default_factory=dict)

    @classmethod
    def read(cls, run_dir: Path) -> RunFacts:
        spec, run_id = read_spec(run_dir)
        facts = cls(run_dir, spec, run_id, records.read_events(run_dir))
        for record in records.read_metrics(run_dir):
            if isinstance(record.get("step"), int) and isinstance(record.get("time"), (int, float)) and not record.get("skipped"):
                facts.series.setdefault(int(record.get("attempt", 1)), {})[record["step"]] = record
        return facts

    @property
    def losses(self) -> dict[int, dict[int, dict[str, Any]]]:
        """The series restricted to records with a loss (a plain script has none)."""
        kept = {a: {s: r for s, r in rows.items() if isinstance(r.get("loss"), (int, float))} for a, rows in self.series.items()}
        return {a: rows for a, rows in kept.items() if rows}

    def named(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == name]

    @property
    def start_time(self) -> float:
        times = [e["time"] for e in self.events[:1]] + [r["time"] for s in self.series.values() for r in s.values()]
        return min(t for t in times if isinstance(t, (int, float)))


def replays(series: dict[int, dict[int, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per later attempt: the steps it repeated from earlier attempts, and whether the losses are identical."""
    out = []
    for attempt in sorted(series)[1:]:
        earlier: dict[int, float] = {}
        for previous in sorted(a for a in series if a < attempt):
            earlier.update({s: r["loss"] for s, r in series[previous].items()})
        common = sorted(set(series[attempt]) & set(earlier))
        if not common:
            continue
        diffs = [abs(series[attempt][s]["loss"] - earlier[s]) for s in common]
        identical = all(same_float(series[attempt][s]["loss"], earlier[s]) for s in common)
        out.append({"attempt": attempt, "first_step": common[0], "last_step": common[-1], "steps": len(common),
                    "identical": identical, "max_abs_diff": max(diffs)})
    return out


def restarts(facts: RunFacts) -> list[dict[str, Any]]:
    """Each restart event joined with the failure that caused it (the failure of the attempt before)."""
    failures = {int(f.get("attempt", 0)): f for f in facts.named("failure")}
    out = []
    for number, event in enumerate(facts.named("restart"), start=1):
        failure = failures.get(int(event.get("attempt", 0)) - 1, {})
        out.append({"number": number, "attempt": event.get("attempt"), "cause": event.get("cause") or failure.get("cause"),
                    "rank": failure.get("rank"), "failed_step": failure.get("step"), "signal": failure.get("signal"),
                    "exception": failure.get("exception"), "snapshot_step": event.get("snapshot_step"),
                    "lost_steps": event.get("lost_steps"), "rto_s": event.get("rto_s"),
                    **{key: event.get(key) for key, _ in RTO_SEGMENTS},
                    "relaunch_to_first_step_s": event.get("relaunch_to_first_step_s")})
    return out


def summarize(facts: RunFacts) -> dict[str, Any]:
    """The run in one JSON-ready table (also what the HTML page shows)."""
    last_attempt = max(facts.series)
    final = facts.series[last_attempt][max(facts.series[last_attempt])]
    losses = facts.losses
    first_loss = losses[min(losses)][min(losses[min(losses)])]["loss"] if losses else None
    final_loss = losses[max(losses)][max(losses[max(losses)])]["loss"] if losses else None
    saves = facts.named("snapshot_saved")
    throughput = [r["samples_per_s"] for s in facts.series.values() for r in s.values() if isinstance(r.get("samples_per_s"), (int, float))]
    precision = facts.named("precision")
    spec = facts.spec
    alive = holder(RunPaths(facts.run_dir)) is not None
    return {
        "run_dir": str(facts.run_dir), "run_id": facts.run_id, "state": run_state(facts.events, alive),
        "script": str(spec.script) if spec is not None and spec.script else "the embedded default job",
        "script_args": list(spec.script_args) if spec is not None else [],
        "ranks": spec.nproc_per_node if spec is not None else None,
        "precision": precision[-1].get("mode") if precision else final.get("precision"),
        "attempts": len(facts.named("attempt_start")) or len(facts.series),
        "restarts": len(facts.named("restart")), "failures": len(facts.named("failure")),
        "step": final["step"], "total_steps": step_budget(spec, None), "first_loss": first_loss, "final_loss": final_loss,
        "wall_s": final["time"] - facts.start_time,
        "median_samples_per_s": statistics.median(throughput) if throughput else None,
        "snapshots_saved": len(saves), "last_snapshot_step": saves[-1].get("step") if saves else None,
        "last_snapshot_bytes": saves[-1].get("bytes") if saves else None,
        "median_save_stall_s": statistics.median(s["stall_s"] for s in saves) if saves and all(isinstance(s.get("stall_s"), (int, float)) for s in saves) else None,
        "stops": len(facts.named("run_stopped")), "resumes": len(facts.named("resume")),
        "restart_details": restarts(facts), "replays": replays(losses),
    }
