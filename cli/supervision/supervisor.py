"""The supervisor: an explicit state machine that runs attempts and decides what follows each one.

Per attempt: STARTING → HEALTHY (first optimizer step seen) → SUCCEEDED,
FAILED (a rank crashed), STALLED (ranks stopped beating: a hang) or, after a
stop request, STOPPING → STOPPED. After FAILED/STALLED the restart policy
says restart (from the newest snapshot the world verified) or give up with
an exit code (design §4). There is exactly one restart counter; torchrun runs
with ``--max-restarts 0``. Recovery checks (:mod:`ckptrun.cli.supervision.recovery`) may
end a run too: an RTO estimate over ``--strict-budget`` (a stop, exit 1), a
diverged resume under ``--require-exact-resume`` (the ranks are killed
without saving the suspect state, exit 4).

Everything the supervisor observes or does goes through a :class:`World`
(launch, observe, tear down, verify, the clock, sleeping), so unit tests
script the observations and run without processes or sleeps. The real world
is :class:`ckptrun.cli.supervision.world.LocalWorld`. Importable without torch.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ckptrun.cli.errors import EXIT_NO, EXIT_OK, EXIT_STOPPED, EXIT_UNRECOVERABLE
from ckptrun.cli.supervision.failures import RankFailure, describe_failure, root_cause
from ckptrun.cli.supervision.observation import AttemptWatch, Observation, Outcome, Snapshot, State, StopControl, World
from ckptrun.cli.supervision.policy import (GiveUp, Restart, RestartFacts, RestartPolicy, Timeouts, pick_suspect,
                                            stale_ranks, waiting_on_peers)
from ckptrun.cli.supervision.recovery import Recovery, RecoveryOptions, relaunch_parts
from ckptrun.cli.supervision import own_checkpoints, unloadable
from ckptrun.cli.supervision.snapshot_source import SnapshotUnavailable
from ckptrun.runtime.faults import parse_faults

STEP_FAULTS = ("kill", "hang", "exit")  # what the bootstrap's step hook fires in a plain script; the rest need the runtime


class Supervisor:
    """Runs attempts until the job succeeds, stops, or the policy gives up."""

    def __init__(self, world: World, policy: RestartPolicy, timeouts: Timeouts, stop: StopControl,
                 first_attempt: int = 1, resume: Snapshot | None = None, recovery: RecoveryOptions | None = None,
                 faults: str | None = None) -> None:
        self.world, self.policy, self.timeouts, self.stop = world, policy, timeouts, stop
        self.first_attempt, self.resume = first_attempt, resume
        self.restarts = 0  # the one restart counter
        self.stalled_restarts = 0
        self.runtime_seen = False  # a runtime heartbeat, or a failure record saying the script imports the runtime
        self.plain_seen = False  # a step-hook heartbeat: the script does not use the runtime
        self.framework_seen = False  # a heartbeat of ckptrun.integrations: Lightning / HF Trainer, its own checkpoints
        self.runtime_only_faults = sorted({f.kind for f in parse_faults(faults)} - set(STEP_FAULTS))
        self.pending_restart: dict[str, Any] | None = None
        self.recovery = Recovery(recovery)
        self.abort: GiveUp | None = None  # a recovery check ended the run

    # --- the loop -------------------------------------------------------------

    def supervise(self) -> Outcome:
        attempt, resume = self.first_attempt, self.resume
        while True:
            watch = self.run_attempt(attempt, resume)
            if self.abort is not None:
                return self._aborted(watch, self.abort)
            if watch.state is State.SUCCEEDED:
                return self._done(watch)
            if watch.state is State.STOPPED:
                return self._stopped(watch)
            set_aside = self._quarantine_unloadable(watch)  # before the verdict: a fallback exists now
            verdict = self.policy.verdict(self._facts(watch, set_aside))
            if isinstance(verdict, GiveUp):
                return self._give_up(watch, verdict)
            try:
                snapshot = self._prepare_restart(watch, verdict)
            except SnapshotUnavailable as exc:  # unknown is not none: never restart from step 0 off the line
                return self._store_failed(watch, str(exc))
            if snapshot is False:
                return self._stopped(watch)
            attempt, resume = attempt + 1, snapshot or None

    def run_attempt(self, attempt: int, resume: Snapshot | None) -> AttemptWatch:
        watch = AttemptWatch(attempt, self.world.now(), resume)
        self.recovery.new_attempt()
        self.world.launch(attempt, resume.path if resume else None)
        self.world.event("attempt_start", attempt=attempt, restarts=self.restarts,
                         resume_from=str(resume.path) if resume else None, snapshot_step=resume.step if resume else None)
        while True:
            observation = self.world.observe()
            self.world.show_progress(attempt, self.restarts, observation, self.recovery.status())
            if self.step(watch, observation):
                self._log_pending_restart(watch, final=True)
                return watch
            self.world.sleep(self.timeouts.poll)

    def step(self, watch: AttemptWatch, obs: Observation) -> bool:
        """Advance the state machine by one observation; True when the attempt is over."""
        self._note(watch, obs)
        if self._check_recovery(watch, obs):
            return True
        if watch.state is not State.STOPPING:
            reason = self.stop.reason(obs.time, obs.stop_file)
            if reason:
                self._begin_stop(watch, reason, obs.time)
        if obs.agent_exit is not None:
            self._ended(watch, obs)
            return True
        if watch.state is State.STOPPING:
            if self.stop.forced or obs.time >= (watch.kill_deadline or obs.time):
                self._force_stop(watch, obs)
                return True
            return False
        stale = stale_ranks(obs, watch.beats, watch.launched, self.timeouts, self.runtime_seen or self.framework_seen)
        if stale:
            self._stalled(watch, obs, stale)
            return True
        return False

    # --- observations -----------------------------------------------------------

    def _note(self, watch: AttemptWatch, obs: Observation) -> None:
        for rank, view in obs.ranks.items():
            if view.beat is not None:
                watch.beats[rank] = view.beat
                if view.beat.source == "runtime":
                    self.runtime_seen = True
                elif view.beat.source == "framework":
                    self._framework_notice()
                else:
                    self._plain_script_notice()
            if not view.alive and watch.gone_at is None:
                watch.gone_at = obs.time
        if obs.last_step is not None:
            watch.last_step, watch.last_step_time = obs.last_step, obs.last_step_time
        if obs.steps and watch.first_step is None:
            watch.first_step = int(obs.steps[0]["step"])
        if obs.first_step_time is not None and watch.first_step_time is None:
            watch.first_step_time = obs.first_step_time
            if watch.state is State.STARTING:
                watch.state = State.HEALTHY

    def _check_recovery(self, watch: AttemptWatch, obs: Observation) -> bool:
        """The RTO budget and the resume check; True when a diverged resume ends the attempt now."""
        recovery = self.recovery
        if obs.steps and not watch.reshard_checked:  # the worker logs `resharded` at restore, before any step
            watch.reshard_checked = True
            if self.world.attempt_events("resharded"):
                recovery.resharded()
            if self.world.attempt_events("global_batch_changed"):
                recovery.batch_changed()
        recovery.note(obs.steps, obs.snapshot_step)
        if recovery.wants_estimate(watch.attempt, obs.snapshot_step, self.pending_restart is not None):
            self.world.request_estimate(self.policy.delay(self.restarts + 1))
        if obs.rto_estimate is not None:
            stop = recovery.estimated(self.world, watch.attempt, obs.rto_estimate)
            if stop is not None and self.abort is None and watch.state is not State.STOPPING:
                self.abort = stop
                self._begin_stop(watch, "the RTO estimate is over --rto-budget (--strict-budget)", obs.time)
        self._log_pending_restart(watch)
        if self.abort is not None or not (recovery.options.require_exact_resume and recovery.diverged()):
            return False
        self.abort = GiveUp(EXIT_UNRECOVERABLE, "the resumed run diverged from the original (--require-exact-resume)",
                            "some state was not restored (RNG, data position, optimizer): see the restart event in "
                            "events.jsonl; the snapshot it resumed from is kept")
        self._log_pending_restart(watch, final=True)
        if obs.agent_exit is not None:
            return False
        self.world.say("the resume diverged: killing the ranks without saving")
        watch.teardown_s = self.world.teardown(failed=True)
        watch.state, watch.forced = State.STOPPED, True
        return True

    @property
    def plain(self) -> bool:
        """The script does not use ckptrun.runtime: its steps are seen only through torch's optimizer hook."""
        return self.plain_seen and not self.runtime_seen and not self.framework_seen

    def _framework_notice(self) -> None:
        if not self.framework_seen:
            self.framework_seen = True
            own_checkpoints.framework_notice(self.world)

    def _plain_script_notice(self) -> None:
        """Said once, when it is known: a step-hook heartbeat, or a failure record of a script without the runtime."""
        if self.plain_seen or self.runtime_seen:
            return
        self.plain_seen = True
        self.world.event("plain_script")
        self.world.say("note: this script does not use ckptrun.runtime: its optimizer steps are watched (hangs, "
                       "status, faults) and a failure restarts it (its optimizer's step count shows whether it "
                       "resumed from its own files); verified snapshots, exact resume and saving on `ckptrun stop` "
                       "need the runtime.")
        if self.runtime_only_faults:
            self.world.say(f"warning: --inject-fault {', '.join(self.runtime_only_faults)} can never fire: "
                           "it needs ckptrun.runtime")

    # --- endings ----------------------------------------------------------------

    def _begin_stop(self, watch: AttemptWatch, reason: str, now: float) -> None:
        self.world.request_stop()
        watch.state, watch.kill_deadline = State.STOPPING, now + self.timeouts.grace
        self.world.event("stop_requested", attempt=watch.attempt, reason=reason, grace_s=self.timeouts.grace,
                         plain_script=self.plain)
        if not self.plain:
            self.world.say(f"stopping ({reason}): the ranks save a snapshot at the next step boundary and exit")
            return
        self.world.say(f"stopping ({reason}): this script does not use ckptrun.runtime, so it cannot be asked to "
                       f"save; sending its ranks SIGTERM and waiting up to {self.timeouts.grace:g}s for them to exit")
        self.world.terminate_ranks()

    def _force_stop(self, watch: AttemptWatch, obs: Observation) -> None:
        why = "a second signal" if self.stop.forced else f"the grace period ({self.timeouts.grace:g}s) ran out"
        self.world.say(f"{why}: killing the ranks")
        watch.teardown_s = self.world.teardown(failed=True)
        watch.state, watch.forced = State.STOPPED, True
        self.world.event("stop_forced", attempt=watch.attempt, reason=why)

    def _ended(self, watch: AttemptWatch, obs: Observation) -> None:
        """torchrun exited: success, the agreed stop, or a crash."""
        stopped_event = bool(self.world.attempt_events("stopped"))
        if watch.state is State.STOPPING and self.plain:
            watch.state, watch.forced = State.STOPPED, obs.agent_exit != 0  # clean only if every rank exited 0
        elif obs.agent_exit == 0 or self._crashed_after_completion(watch, obs):
            watch.state = State.SUCCEEDED
        elif watch.state is State.STOPPING or stopped_event:
            watch.state = State.STOPPED
        else:
            watch.state = State.FAILED
            watch.detected_at = watch.gone_at if watch.gone_at is not None else obs.time
            watch.failure = self._crash_facts(watch, obs)
        watch.teardown_s = self.world.teardown(failed=watch.state is State.FAILED)
        if watch.failure is not None:
            watch.teardown_s = self.world.now() - (watch.detected_at or obs.time)
            self._report_failure(watch)

    def _crashed_after_completion(self, watch: AttemptWatch, obs: Observation) -> bool:
        return own_checkpoints.crashed_after_completion(self.world, watch.attempt, obs.agent_exit)

    def _crash_facts(self, watch: AttemptWatch, obs: Observation) -> dict[str, Any]:
        failures, agent_error = self.world.failures()
        root = root_cause(failures) or RankFailure(rank=None, exit_code=obs.agent_exit,
                                                   exception=agent_error)
        if any(f.uses_runtime for f in failures):
            self.runtime_seen = True  # it failed before its first heartbeat, but it is not a plain script
        elif root.uses_runtime is False:
            self._plain_script_notice()
        beat = watch.beats.get(root.rank) if root.rank is not None else None
        steps = [s for s in (beat.step if beat else None, watch.last_step) if s is not None]
        last_life = max([t for t in (beat.time if beat else None, watch.last_step_time) if t is not None], default=None)
        return {"cause": "crash", **root.to_json(), "step": max(steps, default=None), "last_sign_of_life": last_life,
                "plain_script": self.plain}

    def _stalled(self, watch: AttemptWatch, obs: Observation, stale: list[int]) -> None:
        watch.state, watch.detected_at = State.STALLED, obs.time
        everyone = sorted(r for r, view in obs.ranks.items() if view.alive) or stale
        self.world.say(f"ranks {', '.join(map(str, stale))} made no progress: dumping the stacks of every rank "
                       f"({', '.join(map(str, everyone))}), then restarting")
        stacks = self.world.dump_stacks(everyone)  # the hung rank may still look alive; its peers wait for it
        suspect = pick_suspect(everyone, watch.beats, stacks)
        beat = watch.beats.get(suspect)
        steps = [s for s in (beat.step if beat else None, watch.last_step) if s is not None]
        watch.failure = {"cause": "hang", "rank": suspect, "suspect": suspect, "stale_ranks": stale,
                         "step": max(steps, default=None), "phase": beat.phase if beat else "start",
                         "last_sign_of_life": beat.time if beat else watch.launched, "plain_script": self.plain,
                         "stacks_dumped": everyone,
                         "waiting_on_peers": {str(r): waiting_on_peers(stacks.get(r, "")) for r in everyone}}
        self.world.teardown(failed=True)
        watch.teardown_s = self.world.now() - obs.time
        self._report_failure(watch)

    def _report_failure(self, watch: AttemptWatch) -> None:
        failure = watch.failure or {}
        life = failure.get("last_sign_of_life")
        detect_s = (watch.detected_at - life) if (watch.detected_at and life) else None
        failure.update(attempt=watch.attempt, detected_at=watch.detected_at, detect_s=detect_s)
        self.world.event("failure", **failure)
        self.world.say(f"attempt {watch.attempt} failed: {describe_failure(failure)}")

    # --- after an attempt ---------------------------------------------------------

    def _facts(self, watch: AttemptWatch, set_aside: bool = False) -> RestartFacts:
        new_snapshot = bool(self.world.attempt_events("snapshot_saved") or self.world.attempt_events("memory_saved"))
        self.stalled_restarts = 0 if new_snapshot or not self.runtime_seen else self.stalled_restarts + (
            1 if watch.attempt > self.first_attempt else 0)
        failure = watch.failure or {}
        return RestartFacts(
            first_attempt=watch.attempt == self.first_attempt,
            reached_first_step=watch.first_step_time is not None,
            load_failure=failure.get("phase") == "load",
            fatal=self.world.fatal_records(),
            restarts=self.restarts,
            stalled_restarts=self.stalled_restarts,
            snapshot_set_aside=set_aside,
        )

    def _prepare_restart(self, watch: AttemptWatch, verdict: Restart) -> Snapshot | None | bool:
        """Count the restart, verify the newest snapshot, back off. False when a stop arrives meanwhile."""
        self.restarts += 1
        snapshot = self.world.restart_snapshot()  # the newest durable one, or a newer one of the memory tier
        if not self._wait(verdict.delay):
            return False
        failure = watch.failure or {}
        reached = max((s for s in (watch.last_step, failure.get("step")) if s is not None), default=None)
        lost = (reached - (snapshot.step if snapshot else 0)) if reached is not None else None  # as the failure says
        self.recovery.note(self.world.late_steps(), None)  # records read while the attempt ended
        self.recovery.restarting(snapshot.step if snapshot else None)
        self.pending_restart = {
            "attempt": watch.attempt + 1, "restarts": self.restarts, "cause": failure.get("cause"),
            "snapshot": str(snapshot.path) if snapshot else None, "snapshot_step": snapshot.step if snapshot else None,
            "lost_steps": lost, "detect_s": failure.get("detect_s"), "teardown_s": watch.teardown_s,
            "verify_s": snapshot.verify_s if snapshot else 0.0, "backoff_s": verdict.delay,
        }
        where = (f"from snapshot step {snapshot.step}" if snapshot else
                 "(the script resumes from its newest verified checkpoint)" if self.framework_seen else
                 "(the script should resume from its own files)" if self.plain else "from the start (no verified snapshot)")
        self.world.say(f"restart {self.restarts}/{self.policy.max_restarts}: attempt {watch.attempt + 1} {where}")
        return snapshot

    def _quarantine_unloadable(self, watch: AttemptWatch) -> bool:
        """The attempt could not load the snapshot it was given (its ranks agreed and said so in a
        ``restore_failed`` event): set it aside, so that the restart uses the next newest verified one."""
        if watch.resume is None:
            return False
        for record in self.world.attempt_events("restore_failed"):
            if record.get("snapshot") == str(watch.resume.path):
                reason = str(record.get("reason", ""))
                status = unloadable.status(reason)  # corrupt: a chunk failed its digest; unloadable: bytes match
                moved = self.world.quarantine(watch.resume.path, status, reason)
                self.world.event("snapshot_quarantined", attempt=watch.attempt, snapshot=str(watch.resume.path),
                                 step=watch.resume.step, status=status, reason=record.get("reason"),
                                 cause=unloadable.cause(reason), moved_to=str(moved),
                                 digest_failures=[f.to_json() for f in unloadable.digest_failures(reason)])
                self.world.say(unloadable.describe(watch.resume.step, reason, moved))
                return True
        return False

    def _wait(self, seconds: float) -> bool:
        """Back off, still honouring stop requests (nothing runs meanwhile)."""
        deadline = self.world.now() + seconds
        while self.world.now() < deadline:
            reason = self.stop.reason(self.world.now(), self.world.stop_file_present())
            if reason:
                self.world.event("stop_requested", reason=f"{reason}, during the restart back-off")
                return False
            self.world.sleep(min(self.timeouts.poll, max(0.0, deadline - self.world.now())))
        return True

    def _log_pending_restart(self, watch: AttemptWatch, final: bool = False) -> None:
        """The restart event: the RTO parts once the relaunched attempt's first step shows the last one, the
        resume check once the replayed steps and the throughput window are seen — or whatever is known when
        the attempt ends (``final``)."""
        pending = self.pending_restart
        if pending is None or pending["attempt"] != watch.attempt:
            return
        if "relaunch_to_first_step_s" not in pending and (watch.first_step_time is not None or final):
            pending.update(relaunch_parts(watch.launched, watch.first_step_time, self.world.attempt_events("restored")))
        if not final and (watch.first_step_time is None or not self.recovery.settled()):
            return
        self.pending_restart = None
        if self.plain or self.framework_seen:
            own_checkpoints.after_resume(self.world, watch.attempt, pending, watch.first_step, self.plain)
        self.recovery.log_restart(self.world, pending)

    # --- outcomes -----------------------------------------------------------------

    def _done(self, watch: AttemptWatch) -> Outcome:
        self.world.event("run_completed", attempt=watch.attempt, restarts=self.restarts, step=watch.last_step)
        at = f" at step {watch.last_step}" if watch.last_step is not None else ""
        return Outcome(EXIT_OK, f"run completed{at} after {self.restarts} restart(s)",
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
                           "`ckptrun resume --latest` relaunches it from its own files", attempts, self.restarts)
        return Outcome(EXIT_STOPPED, "stopped: the script exited cleanly on SIGTERM",
                       "continue with `ckptrun resume --latest` (it resumes from its own files)", attempts, self.restarts)

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
