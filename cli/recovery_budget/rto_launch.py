"""The recovery estimate ``ckptrun launch --rto-budget`` makes while the run trains, and the auto-save cap.

Cheap by construction: no probe and no no-op launch (either would compete
with training for the machine). Each component is the one ``estimate-rto``
computes (:mod:`ckptrun.cli.recovery_budget.rto_components`), from this run's history or
measured now: detect and teardown from past restarts, else the poll interval
and a crash's teardown (SIGKILL one second after SIGTERM, not the grace period a stop may take); verify timed on the newest snapshot now (the
supervisor's own check: whole-file digests, or manifest and sizes for chunk digests); the
back-off the next restart will wait; restart from past restarts, else the
path a restart takes: through the warm standby (the default) its hand-over to
forked ranks (modelled), the script's set-up and first step as this run's first
attempt measured them, and the restore; a cold path this run's own launch to
first step (start-up, imports, process group, set-up, one step); the
restore measured now (:func:`rto_components.restore_estimate`: read bandwidth,
and for chunk digests the hash rate as the ranks verify while loading). The supervisor
runs :func:`estimate` on a thread of its own, off its polling path.
Importable without torch.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from ckptrun.cli.durations import format_duration as fmt
from ckptrun.cli.recovery_budget import rto_components as parts
from ckptrun.cli.recovery_budget import rto_history as hist
from ckptrun.cli.recovery_budget.estimate import find_target
from ckptrun.cli.recovery_budget.rto_model import (CONFIGURED, ESTIMATED, RTO_PARTS, Component, budget_verdict,
                                                   cost_per_failure, max_interval, total)
from ckptrun.runtime import records


# A warm standby's hand-over is its dispatch (handed the attempt: rendezvous, ranks forked; a restart's
# `spawn_s`, ~0.15 s here) and the forked ranks' way to their process group, which attempt 1 already ran and
# measured (its `started` event). Launch runs no no-op relaunch to measure the dispatch: it would compete with
# the training it watches. Before, the whole hand-over was modelled as 0.5 s.
STANDBY_DISPATCH_S = 0.15
FORKED_TO_GROUP_S = 0.35  # modelled when attempt 1 noted no fork (spawned ranks) and no process group
VANISHED_RETRIES = 3  # the run goes on while its snapshot is measured: retention may delete it under us


def estimate(run_dir: Path, backoff_s: float, budget_s: float | None) -> dict[str, Any]:
    """The RTO now, each component with its source, and the verdict against ``budget_s`` (the event's fields).

    The snapshot measured is the newest when the estimate starts; if retention deletes it meanwhile (a
    file vanishes mid-read), the estimate starts again on the then-newest one."""
    for _ in range(VANISHED_RETRIES):
        with contextlib.suppress(FileNotFoundError):
            return _estimate(run_dir, backoff_s, budget_s)
    return _estimate(run_dir, backoff_s, budget_s)


def _estimate(run_dir: Path, backoff_s: float, budget_s: float | None) -> dict[str, Any]:
    target = find_target(run_dir)
    checked = parts.verify(target)  # first: a fallback changes the snapshot the rest is about
    components = {
        "detect": parts.detect(target),
        "teardown": parts.teardown(target, None),
        "verify": checked,
        "backoff": Component("backoff", backoff_s, CONFIGURED, "the wait before the next restart (--restart-backoff, doubling)"),
        "restart": restart(target),
    }
    rto = total(components)
    pace = parts.cadence(target)
    fields: dict[str, Any] = {
        "snapshot_step": target.manifest.step,
        "components": {name: {"value_s": c.value_s, "source": c.source, "detail": c.detail} for name, c in components.items()},
        "rto_s": rto, "budget_s": budget_s, "ok": None, "largest": None,
        "cost_per_failure_s": cost_per_failure(rto, pace.interval_s, pace.stall_s, pace.persist_s)
        if rto is not None and pace.interval_s is not None else None,
    }
    if budget_s is not None and rto is not None:
        verdict = budget_verdict({name: float(components[name].value_s or 0.0) for name in RTO_PARTS}, budget_s)
        fields.update(ok=verdict.ok, largest=verdict.largest)
    return fields


def restart(target: parts.Target) -> Component:
    """Past restarts when there are any; else this run's own first launch plus the restore estimated now."""
    if any(isinstance(r.get("relaunch_to_first_step_s"), (int, float)) for r in target.restarts):
        return parts.restart(target, False, target.manifest.world_size, None)
    launch, count = hist.launch_to_first_step(target.events, target.metrics)
    restore, how, _ = parts.restore_estimate(target, target.manifest.world_size)
    path, _ = parts.relaunch_path(target)
    if path.standby and path.warm:  # estimate-rto's model; of the hand-over it measures, the dispatch is modelled
        step, step_words = parts.setup_and_first_step(target)
        handover, handover_words = _handover(target)
        return Component("restart", handover + restore + step, ESTIMATED, f"{handover_words} + {how} + {step_words}",
                         {"relaunch_path": path.name, "cold_s": launch, "handover_s": handover})
    if launch is None:
        return Component("restart", restore, ESTIMATED, how + "; start-up not included (no attempt reached a step yet)")
    return Component("restart", launch + restore, ESTIMATED,
                     f"this run's launch to first step {fmt(launch)} (history, {count} attempt(s)) + {how}")


def _handover(target: parts.Target) -> tuple[float, str]:
    """A warm standby's hand-over: its dispatch (modelled) + forked ranks to the process group (attempt 1's)."""
    forked, count = hist.forked_to_process_group(target.events)
    group_words = f"forked ranks to the process group {fmt(forked)} (attempt 1, {count} start(s))" if forked is not None \
        else f"forked ranks to the process group {fmt(FORKED_TO_GROUP_S)} (modelled)"
    forked = FORKED_TO_GROUP_S if forked is None else forked
    return (STANDBY_DISPATCH_S + forked,
            f"a warm standby's hand-over {fmt(STANDBY_DISPATCH_S + forked)}: its dispatch {fmt(STANDBY_DISPATCH_S)} "
            f"(modelled; `ckptrun estimate-rto` measures it) + {group_words}")


def interval_cap(run_dir: Path, budget_s: float | None) -> float | None:
    """The longest ``--save-every auto`` interval that keeps a failure's expected cost within the budget.

    From the latest ``rto_estimate`` and the measured saves in the run's events:
    τ ≤ 2(B − RTO − w) − δ. Before any estimate (the first attempt) only the
    lost work is bounded (τ ≤ 2B). None without a budget, or when the RTO alone
    leaves no room (the estimate's warning says so).
    """
    if budget_s is None:
        return None
    events = records.read_events(run_dir)
    estimates = [e for e in events if e.get("event") == "rto_estimate" and isinstance(e.get("rto_s"), (int, float))]
    rto = float(estimates[-1]["rto_s"]) if estimates else 0.0
    saves = hist.save_facts(events)
    cap = max_interval(budget_s, rto, saves.stall_s or 0.0, saves.persist_s)
    return cap if cap > 0 else None
