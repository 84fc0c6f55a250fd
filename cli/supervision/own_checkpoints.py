"""Scripts that resume from their own checkpoints: a plain script, or a framework through ckptrun.integrations.

ckptrun picks no snapshot for them, so what a restart cost and whether it resumed at all is read from what
the new attempt reports at its first step: a framework integration's ``framework_started`` event names the
global step it resumed at; a plain script's first step record carries the optimizer's own step count
(:mod:`ckptrun.runtime.worker.step_hook`), so step 1 after an attempt that reached step N means it started
over — said as a ``started_over`` event and a warning that names the fix. Small functions over plain data;
the supervisor calls them with its :class:`World`. Importable without torch.
"""

from __future__ import annotations

from typing import Any

from ckptrun.cli.errors import EXIT_NO, EXIT_STOPPED
from ckptrun.cli.supervision.observation import Observation, Outcome, World

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


def framework_notice(world: World) -> None:
    """Said once: the framework keeps its own checkpoints, published and resumed through ckptrun.integrations."""
    world.event("framework_script")
    world.say("note: this script uses a ckptrun framework integration: a restart resumes from its newest verified "
              "checkpoint (resume_path), `ckptrun stop` saves one; bitwise resume needs the runtime")


def after_resume(world: World, attempt: int, pending: dict[str, Any], first_step: int | None, plain: bool) -> None:
    """No snapshot was chosen: count the lost steps from where the script resumed, and say so — or say that
    it started over (``started_over``), with the fix."""
    resumed = resumed_step(world.attempt_events("framework_started"), plain, first_step)
    started_over = account(pending, resumed)
    if started_over is None:
        world.say(describe_resume(attempt, resumed))
        return
    world.event("started_over", **started_over)
    world.say(f"warning: attempt {attempt} started over at step 1 (attempt {attempt - 1} reached step "
              f"{started_over['previous_step']}): {STARTED_OVER_HINT}")


def crashed_after_completion(world: World, attempt: int, exit_code: int | None) -> bool:
    """The ranks logged ``completed`` (the final snapshot is published), then exited non-zero: the run is done,
    never restarted (a restart would train past its end and let retention delete the final snapshot)."""
    completed = world.attempt_events("completed")
    if not completed:
        return False
    step = completed[-1].get("step")
    world.event("crashed_after_completion", attempt=attempt, exit_code=exit_code, step=step)
    world.say(f"warning: the script exited {exit_code} after the run completed at step {step} (its final "
              "snapshot is kept; not restarted): see its log under logs/")
    return True


def died_after_return(world: World, attempt: int, obs: Observation) -> bool:
    """A plain script whose every rank beat ``returned`` (the bootstrap saw the script return without an
    error) and then exited non-zero died in the interpreter's teardown — a process group's thread aborting
    at exit ("terminate called without an active exception"): the script had finished, so the run did,
    never relaunched (a relaunch would train a finished job again)."""
    beats = [view.beat for view in obs.ranks.values()]
    if not beats or any(b is None or b.phase != "returned" for b in beats):
        return False
    step = max(b.step for b in beats if b is not None)
    world.event("died_after_return", attempt=attempt, exit_code=obs.agent_exit, step=step)
    world.say(f"warning: the script returned on every rank at step {step}, then a rank exited "
              f"{obs.agent_exit} in the interpreter's teardown: counted as completed, not relaunched")
    return True


def framework_stopped(world: World, attempt: int, forced: bool, last_step: int | None, attempts: int,
                      restarts: int) -> Outcome:
    """A framework script's stop: resumable when it saved its checkpoint at the agreed step (its ``stopped``
    event names it)."""
    stopped = world.attempt_events("stopped")
    world.event("run_stopped", attempt=attempt, forced=forced, framework=True,
                step=stopped[-1].get("step") if stopped else last_step,
                checkpoint=stopped[-1].get("checkpoint") if stopped else None)
    saved = stopped[-1] if stopped and stopped[-1].get("checkpoint") else None
    if saved is None or forced:
        return Outcome(EXIT_NO, "stopped, but the script saved no checkpoint at the stop",
                       "`ckptrun resume --latest` relaunches it from its newest verified checkpoint, if any",
                       attempts, restarts)
    return Outcome(EXIT_STOPPED, f"stopped; the script saved its checkpoint at step {saved.get('step')} "
                   f"({saved.get('checkpoint')})", "continue with `ckptrun resume --latest`", attempts, restarts)
