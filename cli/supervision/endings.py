"""How a supervised run ends: each ending's closing event, its exit code and what a person is told.

The endings of :class:`ckptrun.cli.supervision.supervisor.Supervisor`'s loop —
completed, stopped (a runtime script saved; a plain script was sent SIGTERM),
the snapshot store failing, a recovery check aborting, the restart policy
giving up — kept apart from the state machine that reaches them. A mixin of
the supervisor: it reads the run's counters and acts through its world.
Importable without torch.
"""

from __future__ import annotations

from dataclasses import replace

from ckptrun.cli.errors import EXIT_NO, EXIT_OK, EXIT_STOPPED
from ckptrun.cli.supervision import own_checkpoints
from ckptrun.cli.supervision.failures import describe_failure
from ckptrun.cli.supervision.observation import AttemptWatch, Outcome, World
from ckptrun.cli.supervision.policy import GiveUp
from ckptrun.cli.supervision.recovery import Recovery
from ckptrun.cli.supervision.snapshot_source import SnapshotUnavailable


class Endings:
    """The outcomes of :class:`~ckptrun.cli.supervision.supervisor.Supervisor` (its state, declared here)."""

    world: World
    recovery: Recovery
    first_attempt: int
    restarts: int
    runtime_seen: bool  # a runtime heartbeat, or a failure record saying the script imports the runtime
    plain_seen: bool  # a step-hook heartbeat: the script does not use the runtime
    framework_seen: bool  # a heartbeat of ckptrun.integrations: Lightning / HF Trainer, its own checkpoints

    @property
    def plain(self) -> bool:
        """The script does not use ckptrun.runtime: its steps are seen only through torch's optimizer hook."""
        return self.plain_seen and not self.runtime_seen and not self.framework_seen

    def _done(self, watch: AttemptWatch) -> Outcome:
        off = self.world.attempt_events("memory_tier_off")  # a tier asked for and lost: said, never silent
        self.world.event("run_completed", attempt=watch.attempt, restarts=self.restarts, step=watch.last_step,
                         tiers_off=["memory"] if off else [])
        at = f" at step {watch.last_step}" if watch.last_step is not None else ""
        lost = f", but without the memory tier since step {off[0].get('step')}: {off[0].get('reason')}" if off else ""
        return Outcome(EXIT_OK, f"run completed{at} after {self.restarts} restart(s){lost}",
                       attempts=watch.attempt - self.first_attempt + 1, restarts=self.restarts)

    def _stopped(self, watch: AttemptWatch) -> Outcome:
        if self.plain:
            return self._plain_stopped(watch)
        if self.framework_seen:
            return self._framework_stopped(watch)
        stopped = self.world.attempt_events("stopped")
        try:
            step = self.world.newest_step()  # from a store's listing: a stop does not download the snapshot
        except SnapshotUnavailable as exc:
            return self._store_failed(watch, str(exc), stopping=True)
        attempts = watch.attempt - self.first_attempt + 1
        self.world.event("run_stopped", attempt=watch.attempt, forced=watch.forced,
                         step=stopped[-1].get("step") if stopped else watch.last_step, snapshot_step=step)
        if step is None:
            return Outcome(EXIT_NO, "stopped before any verified snapshot existed; nothing to resume",
                           "launch the run again (add --save-every-steps to save sooner)", attempts, self.restarts)
        return Outcome(EXIT_STOPPED, f"stopped; newest verified snapshot: step {step}",
                       "continue with `ckptrun resume --latest`", attempts, self.restarts)

    def _store_failed(self, watch: AttemptWatch, reason: str, stopping: bool = False) -> Outcome:
        """The snapshot store failed after retries: end resumably (exit 3), whatever was saved is kept."""
        self.world.event("run_stopped" if stopping else "gave_up", attempt=watch.attempt, exit_code=EXIT_STOPPED,
                         reason=reason, restarts=self.restarts, forced=watch.forced)
        return Outcome(EXIT_STOPPED, f"{'stopped' if stopping else 'cannot restart'}: {reason}",
                       "once the store answers again, continue with `ckptrun resume --latest` (pass the credentials "
                       "again with --storage-option if the run took them from there)",
                       watch.attempt - self.first_attempt + 1, self.restarts)

    def _plain_stopped(self, watch: AttemptWatch) -> Outcome:
        """A plain script was sent SIGTERM: resumable only if it exited cleanly (then it saved what it saves)."""
        attempts = watch.attempt - self.first_attempt + 1
        self.world.event("run_stopped", attempt=watch.attempt, forced=watch.forced, step=watch.last_step,
                         snapshot_step=None, plain_script=True)
        if watch.forced:
            return Outcome(EXIT_NO, "the script did not exit cleanly on SIGTERM (it was killed or exited non-zero); "
                           "whether it saved its state is unknown", "look at its log under logs/; "
                           "`ckptrun resume --latest` relaunches it (it resumes only if it loads its own "
                           "checkpoint)", attempts, self.restarts)
        return Outcome(EXIT_STOPPED, "stopped: the script exited cleanly on SIGTERM",
                       "continue with `ckptrun resume --latest` (it resumes only if it loads its own checkpoint, "
                       "e.g. given --restart-args)", attempts, self.restarts)

    def _framework_stopped(self, watch: AttemptWatch) -> Outcome:
        return own_checkpoints.framework_stopped(self.world, watch.attempt, watch.forced, watch.last_step,
                                                 watch.attempt - self.first_attempt + 1, self.restarts)

    def _aborted(self, watch: AttemptWatch, verdict: GiveUp) -> Outcome:
        """A recovery check ended the run: an RTO over a strict budget, a diverged resume."""
        if self.recovery.options.require_exact_resume and self.recovery.diverged():
            verdict = self._abandon_diverged(watch, verdict)
        self.world.event("gave_up", attempt=watch.attempt, exit_code=verdict.code, reason=verdict.reason,
                         restarts=self.restarts)
        return Outcome(verdict.code, verdict.reason, verdict.hint, watch.attempt - self.first_attempt + 1, self.restarts)

    def _abandon_diverged(self, watch: AttemptWatch, verdict: GiveUp) -> GiveUp:
        """The ranks are gone: what the diverged attempt saved moves out of the lineage, so that neither
        `resume --latest` nor a restart picks it; the hint says what happened to it."""
        moved = self.world.abandon_after(watch.resume.path if watch.resume else None)
        if not moved:
            return replace(verdict, hint=f"{verdict.hint}; nothing after the divergence was saved")
        self.world.event("snapshots_abandoned", attempt=watch.attempt, reason="diverged resume",
                         snapshots=[str(p) for p in moved])
        names = ", ".join(p.name for p in moved)
        return replace(verdict, hint=f"{verdict.hint}; what the diverged attempt saved ({names}) was moved to "
                                     f"{moved[0].parent} and will not be resumed from")

    def _give_up(self, watch: AttemptWatch, verdict: GiveUp) -> Outcome:
        failure = watch.failure or {}
        self.world.event("gave_up", attempt=watch.attempt, exit_code=verdict.code, reason=verdict.reason,
                         restarts=self.restarts)
        log = failure.get("log")
        if failure.get("stderr_tail"):
            self.world.say(f"the last lines rank {failure.get('rank')} wrote to stderr:")
            for line in failure["stderr_tail"]:
                self.world.say(f"  | {line}")
        hint = verdict.hint + (f"; full log in {log}" if log else "")
        return Outcome(verdict.code, f"{verdict.reason}: {describe_failure(failure)}", hint,
                       watch.attempt - self.first_attempt + 1, self.restarts)
