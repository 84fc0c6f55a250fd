"""What the supervisor checks about recovery while it watches: the RTO against its budget, and each resume.

* ``--rto-budget``: after the first snapshot of each attempt the supervisor
  asks its world for an estimate (:mod:`ckptrun.cli.recovery_budget.rto_launch`, on a thread);
  the result becomes an ``rto_estimate`` event, a warning (once) when it is
  over budget, or with ``--strict-budget`` a stop (exit 1).
* After a restart the replayed steps are compared with the failed attempt's
  (:mod:`ckptrun.cli.supervision.resume_check`); ``--require-exact-resume`` ends the run
  (exit 4) on ``diverged``.
* Every ``restart`` event carries ``rto_measured_s``, ``rto_estimated_s`` (the
  estimate made before the failure), ``rto_budget_s`` and the resume fields.

:class:`Recovery` holds that state over plain data; the supervisor feeds it
observations and acts on its answers. Importable without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ckptrun.cli.durations import format_duration as fmt
from ckptrun.cli.errors import EXIT_NO
from ckptrun.cli.supervision.policy import GiveUp
from ckptrun.cli.supervision.resume_check import DIVERGED, ResumeWatch, StepLog, flagged

# The change that shrinks each recovery part most: the supervisor's hint when an estimate is over budget,
# and estimate-rto's and preflight's.
CUT = {
    "detect": "a crash is found within one poll; for hangs lower --heartbeat-timeout",
    "teardown": "a failed attempt's ranks get SIGKILL 1 s after SIGTERM: a slow teardown is the process tree's own exit (large host memory to unmap, a dataloader's workers)",
    "verify": "verification reads and hashes every byte: blake3 (hash_algorithm = \"blake3\" in --config) hashes faster, smaller snapshots help",
    "backoff": "lower --restart-backoff",
    "restart": "start-up and restore dominate: smaller snapshots, faster storage, fewer imports and less set-up before training",
    "lost_work": "save more often (--save-every-seconds; with --mtbf the report recommends an interval)",
}
# + relaunch_to_first_step_s; node_join_s (many nodes): the leader's wait for every node's teardown and a lost
# node's replacement, after its own teardown and before the verify
RTO_PARTS = ("detect_s", "teardown_s", "node_join_s", "verify_s", "backoff_s")


class Reporter(Protocol):
    """The part of the supervisor's world that records and tells."""

    def event(self, name: str, **fields: Any) -> None: ...
    def say(self, line: str) -> None: ...


@dataclass(frozen=True)
class RecoveryOptions:
    """The launch flags that drive the checks."""

    deterministic: bool = True  # --deterministic: replayed losses must be bitwise equal
    require_exact_resume: bool = False  # stop (exit 4) when a resume diverges
    rto_budget_s: float | None = None  # --rto-budget; None: no estimate during the run
    strict_budget: bool = False  # stop (exit 1) when the estimate exceeds the budget


class Recovery:
    """The latest RTO estimate, the step log of the attempt being watched, and the check of the last resume."""

    def __init__(self, options: RecoveryOptions | None = None) -> None:
        self.options = options or RecoveryOptions()
        self.steps = StepLog()
        self.resume: ResumeWatch | None = None
        self.estimate: dict[str, Any] | None = None
        self.requested: set[int] = set()  # attempts whose estimate was asked for
        self.warned = False
        self.measured_s: float | None = None  # the RTO the latest restart measured
        self.estimated_s: float | None = None  # the estimate made before the latest failure

    # --- feeding ---

    def new_attempt(self) -> None:
        self.steps = StepLog()

    def note(self, steps: list[dict[str, Any]], snapshot_step: int | None) -> None:
        for record in steps:
            self.steps.add(record)
            if self.resume is not None:
                self.resume.add(record)
        if snapshot_step is not None:
            self.steps.saved(snapshot_step)

    # --- the budget ---

    def wants_estimate(self, attempt: int, snapshot_step: int | None, restart_pending: bool) -> bool:
        """True once per attempt, at its first snapshot, when a budget was given — after the restart event
        that relaunched the attempt is written, so that the estimate uses what that restart measured."""
        if self.options.rto_budget_s is None or snapshot_step is None or restart_pending or attempt in self.requested:
            return False
        self.requested.add(attempt)
        return True

    def estimated(self, world: Reporter, attempt: int, fields: dict[str, Any]) -> GiveUp | None:
        """Log a finished estimate; over budget, warn once — or, with --strict-budget, the reason to stop."""
        if "error" in fields:
            world.say(f"note: could not estimate the RTO: {fields['error']}")
            return None
        world.event("rto_estimate", attempt=attempt, **fields)
        if fields.get("rto_s") is not None:
            self.estimate = fields
        if fields.get("ok") is not False or self.warned:
            return None
        self.warned = True
        if self.options.strict_budget:
            return GiveUp(EXIT_NO, describe(fields), budget_hint(fields, strict=True))
        world.say(f"warning: {describe(fields)}")
        world.say(f"hint: {budget_hint(fields, strict=False)}")
        return None

    # --- resumes ---

    def restarting(self, snapshot_step: int | None) -> None:
        """The watched attempt failed: its steps after ``snapshot_step`` are the originals of the next one."""
        self.resume = ResumeWatch(self.steps.after(snapshot_step or 0), list(self.steps.recent),
                                  self.options.deterministic, self.steps.own_after(snapshot_step or 0))
        self.estimated_s = self.estimate.get("rto_s") if self.estimate else None

    def resharded(self) -> None:
        """The watched attempt restored at another world size: its check allows the mode's tolerance."""
        if self.resume is not None:
            self.resume.resharded = True

    def batch_changed(self) -> None:
        """The watched attempt runs another global batch (a node came or went): its losses are not comparable."""
        if self.resume is not None:
            self.resume.original, self.resume.own_original = {}, {}

    def diverged(self) -> bool:
        return self.resume is not None and self.resume.diverged_early

    def settled(self) -> bool:
        return self.resume is None or self.resume.settled()

    def log_restart(self, world: Reporter, pending: dict[str, Any]) -> None:
        """The ``restart`` event: each RTO part measured, their total, the budget and resume checks."""
        relaunch = pending.get("relaunch_to_first_step_s")
        rto = sum(pending.get(k) or 0.0 for k in RTO_PARTS) + relaunch if relaunch is not None else None
        checks = self.restart_fields(rto)
        world.event("restart", **pending, rto_s=rto, **checks)
        if self.resume is not None:
            world.say(self.words(checks))

    def restart_fields(self, rto_s: float | None) -> dict[str, Any]:
        """Measured vs estimated vs budget, the resume verdict and the throughput ratio."""
        self.measured_s = rto_s if rto_s is not None else self.measured_s
        fields: dict[str, Any] = {"rto_measured_s": rto_s,
                                  "rto_estimated_s": self.estimated_s,
                                  "rto_budget_s": self.options.rto_budget_s}
        if self.resume is not None:
            fields.update(self.resume.fields())
            fields["throughput_flagged"] = flagged(fields["throughput_ratio"])
        return fields

    def words(self, fields: dict[str, Any]) -> str:
        """The restart's check, for a person."""
        verdict = fields.get("resume_verdict")
        text = ("WARNING: " if verdict == DIVERGED else "") + f"resume check: {verdict or 'no replayed step to compare'}"
        if verdict is not None:
            diff = fields.get("resume_max_rel_diff")
            text += f" over {fields['replayed_steps']} replayed step(s)" + (
                f", max relative difference {diff:.3g}" if diff else "")
        ratio = fields.get("throughput_ratio")
        if ratio is not None:
            text += f"; throughput after the restart {ratio:.2f}× the rate before the failure"
            text += " (WARNING: beyond ±20%)" if fields.get("throughput_flagged") else ""
        return text

    def status(self) -> dict[str, Any]:
        """The status line's recovery fields."""
        verdict = self.resume.state() if self.resume is not None and self.resume.original else None
        return {"rto_s": self.measured_s, "rto_estimate_s": self.estimate.get("rto_s") if self.estimate else None,
                "rto_budget_s": self.options.rto_budget_s, "resume": verdict}


def describe(fields: dict[str, Any]) -> str:
    """One line for a person: the RTO estimate against the budget, and the part to cut first."""
    budget = fields.get("budget_s")
    line = f"RTO estimate {fmt(fields.get('rto_s'))} (after snapshot step {fields.get('snapshot_step')})"
    if budget is not None:
        line += f" {'is within' if fields.get('ok') else 'exceeds'} --rto-budget {fmt(budget)}"
    largest = fields.get("largest")
    if largest:
        part = fields["components"][largest]
        line += f"; largest part: {largest} {fmt(part['value_s'])} ({part['source']})"
    return line


def budget_hint(fields: dict[str, Any], strict: bool) -> str:
    """What to do about an RTO over budget."""
    cut = CUT.get(fields.get("largest") or "", "see `ckptrun estimate-rto RUN_DIR`")
    tail = "; `ckptrun resume --latest` continues the run" if strict else ""
    return f"{cut}; or raise --rto-budget (now {fmt(fields.get('budget_s'))}){tail}"


# start-up, split at the worker's milestones (ckptrun.runtime.worker.timeline): each part ends at its milestone
STARTUP_PARTS = (("process", "spawn_s"),  # torchrun's own start, rendezvous, spawning the worker
                 ("bootstrap", "interpreter_s"),  # the worker's Python and the bootstrap's imports
                 ("torch_imported", "import_torch_s"),
                 ("init", "script_imports_s"),  # the rest of the script's imports, up to init()
                 ("process_group", "process_group_s"),
                 ("restore_start", "until_restore_s"))  # the rest of init(), building the model and optimizer


def relaunch_parts(launched: float, first_step: float | None, restored: list[dict[str, Any]]) -> dict[str, float | None]:
    """relaunch_to_first_step_s and its parts: start-up (processes, imports, process group), restore, first step.

    ``startup_s`` is split into :data:`STARTUP_PARTS` where rank 0 noted its milestones; a milestone it
    did not pass (torch imported before the bootstrap ran, no process group) folds into the next part.
    """
    parts: dict[str, float | None] = {"relaunch_to_first_step_s": (first_step - launched) if first_step else None}
    if restored:
        event = restored[-1]
        restore_s = float(event.get("seconds", 0.0))
        restore_start = float(event["time"]) - restore_s
        parts.update(startup_s=restore_start - launched, restore_s=restore_s,
                     first_step_s=(first_step - float(event["time"])) if first_step else None)
        marks = {**(event.get("startup") or {}), "restore_start": restore_start}
        if isinstance(marks.get("process"), (int, float)):  # a process's start time reads up to ~1 s early
            marks["process"] = max(marks["process"], launched)  # (a warm standby spawns within that)
        previous = launched
        for milestone, part in STARTUP_PARTS:
            if isinstance(marks.get(milestone), (int, float)) and previous <= marks[milestone] <= restore_start:
                parts[part], previous = marks[milestone] - previous, marks[milestone]
    return parts
