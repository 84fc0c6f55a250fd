"""Scripts that resume from their own checkpoints: a plain script, or a framework through ckptrun.integrations.

ckptrun picks no snapshot for them, so what a restart cost and whether it resumed at all is read from what
the new attempt reports at its first step: a framework integration's ``framework_started`` event names the
global step it resumed at; a plain script's first step record carries the optimizer's own step count
(:mod:`ckptrun.runtime.worker.step_hook`), so step 1 after an attempt that reached step N means it started
over — said as a ``started_over`` event and a warning that names the fix. Pure functions over plain data;
the supervisor calls them. Importable without torch.
"""

from __future__ import annotations

from typing import Any

from ckptrun.cli.errors import EXIT_NO, EXIT_STOPPED
from ckptrun.cli.supervision.observation import Outcome

STARTED_OVER_HINT = ("the script did not resume from its own checkpoint: pass the flag it needs to resume with "
                     "`ckptrun launch --restart-args \"--resume\"` (added on every restart and on resume; "
                     "CKPTRUN_RESTART=1 is set then), or the framework's resume argument "
                     "(ckptrun.integrations: resume_path)")


def resumed_step(framework_started: list[dict[str, Any]], plain: bool, first_step: int | None) -> int | None:
    """The global step the new attempt resumed at (0: it started over); None when it cannot be told."""
    if framework_started:
        return int(framework_started[-1]["step"])
    if plain and first_step is not None:
        return first_step - 1  # the step hook's first record is the optimizer's count after one step
    return None


def account(pending: dict[str, Any], resumed: int | None) -> dict[str, Any] | None:
    """Count the restart's lost steps from where the script resumed (the pending restart event is updated);
    returns the facts of a ``started_over`` event when it went back to step 0 after more than one step."""
    if pending.get("snapshot") is not None:
        return None
    reached = pending.get("lost_steps")  # without a snapshot: every step the failed attempt reached
    pending["resumed_step"] = resumed
    if resumed is None or reached is None:
        pending["lost_steps"] = None if resumed is None else pending.get("lost_steps")
        return None
    pending["lost_steps"] = max(0, reached - resumed)
    if resumed == 0 and reached > 1:
        return {"attempt": pending["attempt"], "previous_step": reached, "lost_steps": reached}
    return None


def describe_resume(attempt: int, resumed: int | None) -> str:
    if resumed is None:
        return f"attempt {attempt}: whether the script resumed from its own files is unknown (no step count)"
    return f"attempt {attempt}: the script resumed from its own checkpoint at step {resumed}"


def framework_stopped(stopped: list[dict[str, Any]], forced: bool, attempts: int, restarts: int) -> Outcome:
    """A framework script's stop: resumable when it saved its checkpoint at the agreed step."""
    saved = stopped[-1] if stopped and stopped[-1].get("checkpoint") else None
    if saved is None or forced:
        return Outcome(EXIT_NO, "stopped, but the script saved no checkpoint at the stop",
                       "`ckptrun resume --latest` relaunches it from its newest verified checkpoint, if any",
                       attempts, restarts)
    return Outcome(EXIT_STOPPED, f"stopped; the script saved its checkpoint at step {saved.get('step')} "
                   f"({saved.get('checkpoint')})", "continue with `ckptrun resume --latest`", attempts, restarts)
