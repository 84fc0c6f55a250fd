"""The supervisor: an explicit state machine that runs attempts and decides what follows each one.

Per attempt: STARTING → HEALTHY (first optimizer step seen) → SUCCEEDED,
FAILED (a rank crashed), STALLED (ranks stopped beating: a hang) or, after a
stop request, STOPPING → STOPPED. After FAILED/STALLED the restart policy
says restart (from the newest snapshot the world verified) or give up with
an exit code (design §4). There is exactly one restart counter; torchrun runs
with ``--max-restarts 0``. Recovery checks (:mod:`ckptrun.cli.supervision.recovery`) may end a run too: an
RTO estimate over ``--strict-budget`` (a stop, exit 1), a diverged resume under ``--require-exact-resume``
(the ranks are killed without saving the suspect state, exit 4).

One loop for one node and for many: a single-node run is a many-node run of
one node. Between attempts the loop asks its :class:`~ckptrun.cli.supervision.job.Job`:
alone it leads itself; on many nodes the leader gathers the nodes before its
verdict and publishes the next attempt, and a follower runs the attempt the leader publishes or ends with
its verdict (:class:`ckptrun.cli.supervision.node_agent.NodeJob`). Endings: :mod:`ckptrun.cli.supervision.endings`.

Everything the supervisor observes or does goes through a :class:`World`
(launch, observe, tear down, verify, the clock, sleeping), so unit tests
script the observations and run without processes or sleeps. The real world
is :class:`ckptrun.cli.supervision.world.LocalWorld` (one node of many:
:class:`ckptrun.cli.supervision.node_world.NodeWorld`). Importable without torch.
"""

from __future__ import annotations

from typing import Any

from ckptrun.cli.errors import EXIT_UNRECOVERABLE
from ckptrun.cli.supervision.endings import Endings
from ckptrun.cli.supervision.failures import RankFailure, describe_failure, root_cause
from ckptrun.cli.supervision.job import Job, JobLost, Next, OneNode
from ckptrun.cli.supervision.observation import AttemptWatch, Observation, Outcome, Snapshot, State, StopControl, World
from ckptrun.cli.supervision.policy import (GiveUp, Restart, RestartFacts, RestartPolicy, Timeouts, pick_suspect,
                                            stale_ranks, waiting_on_peers)
from ckptrun.cli.supervision.recovery import Recovery, RecoveryOptions, relaunch_parts
from ckptrun.cli.supervision import own_checkpoints, unloadable
from ckptrun.cli.supervision.snapshot_source import SnapshotUnavailable
from ckptrun.runtime.faults import parse_faults

STEP_FAULTS = ("kill", "hang", "exit")  # what the bootstrap's step hook fires in a plain script; the rest need the runtime


class Supervisor(Endings):
    """Runs attempts until the job succeeds, stops, or the policy gives up."""

    def __init__(self, world: World, policy: RestartPolicy, timeouts: Timeouts, stop: StopControl,
                 first_attempt: int = 1, resume: Snapshot | None = None, recovery: RecoveryOptions | None = None,
                 faults: str | None = None, job: Job | None = None) -> None:
        self.world, self.policy, self.timeouts, self.stop = world, policy, timeouts, stop
        self.job: Job = job or OneNode()  # where the job's decisions are taken: here alone, or with other nodes
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
        """Attempt → observe → decide (restart, stop, give up) → the next attempt, until the job ends."""
        try:
            outcome = self._supervise()
        except JobLost as exc:  # many nodes: the leader's store is gone
            return self.job.lost(str(exc), self.restarts)
        self.job.ended(outcome, self.restarts)
        return outcome

    def _supervise(self) -> Outcome:
        start = self.job.start(self.first_attempt, self.resume)
        if isinstance(start, Outcome):
            return start
        attempt, resume = start
        self.first_attempt = attempt  # a follower joins at the leader's attempt: its restarts count from there
        while True:
            watch = self.run_attempt(attempt, resume)
            if self.abort is not None:
                return self._aborted(watch, self.abort)
            if watch.state is State.SUCCEEDED:
                return self._done(watch)
            if watch.state is State.STOPPED:
                return self._stopped(watch)
            self.job.torn_down(watch)
            step = self._decide(watch) if self.job.leads else self._follow(attempt)
            if isinstance(step, Outcome):
                return step
            attempt, resume = step

    def _decide(self, watch: AttemptWatch) -> Next | Outcome:
        """The leader's verdict on a failed attempt (one node leads itself): restart, stop or give up."""
        missing = self.job.gather(watch)  # many nodes: the first failure, every teardown, lost nodes
        if missing is not None:
            return self._give_up(watch, missing)
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
        self.job.restarting(watch, snapshot or None, self.pending_restart)
        return watch.attempt + 1, snapshot or None

    def _follow(self, attempt: int) -> Next | Outcome:
        """A follower runs the leader's next attempt (its restarts count as the leader's) or ends with its verdict."""
        step = self.job.follow(attempt)
        if not isinstance(step, Outcome):
            self.restarts = max(self.restarts, step[0] - self.first_attempt)
        return step

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
        if any(record.get("source") == "step-hook" for record in obs.steps):  # plain, though maybe over unpolled
            self._plain_script_notice()
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
                       "picked up where it left off); verified snapshots, exact resume and saving on `ckptrun stop` "
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
        elif obs.agent_exit == 0 or self._finished_before_exit(watch, obs):
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

    def _finished_before_exit(self, watch: AttemptWatch, obs: Observation) -> bool:
        """A non-zero exit after the run had finished: completed, never relaunched (see :mod:`own_checkpoints`)."""
        return own_checkpoints.crashed_after_completion(self.world, watch.attempt, obs.agent_exit) or \
            self.plain and own_checkpoints.died_after_return(self.world, watch.attempt, obs)

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
        if (root := self.job.root_cause(watch)) is not None:  # many nodes: another node's may have come first
            failure.update(collateral=describe_failure(failure), root_cause=root)
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
                 "(the script is relaunched: its step count will say whether it resumed)" if self.plain else
                 "from the start (no verified snapshot)")
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
        """The restart event: the RTO parts once the relaunched attempt's first step shows the last one, the resume
        check once the replayed steps and the throughput window are seen, or what is known at the end (``final``)."""
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
