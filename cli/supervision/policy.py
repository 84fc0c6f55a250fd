"""The supervisor's small, pure decisions: is a rank hung, who is the suspect, restart or give up.

Each is a function or a tiny object over plain data, tested with tables
(``tests/test_supervisor_unit.py``). Importable without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptrun.cli.errors import EXIT_NO, EXIT_UNRECOVERABLE
from ckptrun.runtime.records import Heartbeat

if TYPE_CHECKING:
    from ckptrun.cli.supervision.observation import Observation

STACK_WAIT_S = 3.0  # longest wait for a hung rank's stack dump (SIGUSR2) before teardown
FATAL_CODES = (1, 2, 4)  # a worker's fatal record may ask for these exit codes; anything else means 4


@dataclass(frozen=True)
class Timeouts:
    """How long silence may last before it is a hang, per heartbeat phase; plus the stop grace period."""

    heartbeat: float = 300.0  # phase train
    startup: float = 600.0  # no heartbeat yet, phases init and restore
    save: float = 900.0  # phase save
    grace: float = 60.0
    poll: float = 0.2

    def allowance(self, beat: Heartbeat | None) -> float | None:
        """Seconds of silence allowed in this phase (None: not watched)."""
        if beat is None or beat.phase in ("init", "restore"):
            return self.startup
        if beat.phase == "train":
            return self.heartbeat
        if beat.phase == "save":
            return self.save
        return None  # done / stopping: the rank is leaving; torchrun's exit ends the attempt


def stale_ranks(obs: "Observation", beats: dict[int, Heartbeat], launched: float, timeouts: Timeouts,
                runtime_seen: bool) -> list[int]:
    """Live ranks silent for longer than their phase allows (ranks without a heartbeat only once the
    runtime has been seen in this run: a plain script never beats)."""
    stale = []
    for rank, view in sorted(obs.ranks.items()):
        if not view.alive:
            continue
        beat = beats.get(rank)
        if beat is None and not runtime_seen:
            continue
        allowance = timeouts.allowance(beat)
        since = beat.time if beat is not None else launched
        if allowance is not None and obs.time - since > allowance:
            stale.append(rank)
    return stale


def main_thread_frame(dump: str) -> str | None:
    """The innermost frame of the main thread in a faulthandler dump (the thread that runs ``<module>``)."""
    for block in dump.split("\n\n"):
        frames = [line.strip() for line in block.splitlines() if line.strip().startswith("File ")]
        if frames and any(" in <module>" in f or "_run_module_as_main" in f for f in frames):
            return frames[0]
    return None


def waiting_on_peers(dump: str) -> bool | None:
    """True when the main thread sits inside torch (a collective, or DDP's all-reduce inside backward):
    such a rank waits for another one. False when it is in the script's own code; None without a dump."""
    frame = main_thread_frame(dump)
    if frame is None:
        return None
    return "/torch/" in frame or "distributed_c10d" in frame


def pick_suspect(stale: list[int], beats: dict[int, Heartbeat], stacks: dict[int, str]) -> int:
    """The rank most likely at fault: one not waiting inside torch, else the least progressed, else
    the one silent longest. Ranks blocked in a collective are waiting for the suspect."""

    def key(rank: int) -> tuple[int, int, float]:
        beat = beats.get(rank)
        waiting = {False: 0, None: 1, True: 2}[waiting_on_peers(stacks.get(rank, ""))]
        return (waiting, beat.step if beat else -1, beat.time if beat else 0.0)

    return min(stale, key=key)


@dataclass(frozen=True)
class RestartFacts:
    """What the policy needs to know about the attempt that just failed."""

    first_attempt: bool  # the first attempt of this launch/resume
    reached_first_step: bool  # a step record of the attempt (the runtime's, or the step hook's for a plain script)
    load_failure: bool  # the script failed to load (syntax error, missing file)
    restarts: int  # restarts done so far
    stalled_restarts: int  # restarts in a row that brought no new snapshot
    fatal: list[dict[str, Any]] = field(default_factory=list)  # workers' "a restart cannot help" records
    snapshot_set_aside: bool = False  # the snapshot the attempt was given did not load and was quarantined


@dataclass(frozen=True)
class Restart:
    delay: float


@dataclass(frozen=True)
class GiveUp:
    code: int
    reason: str
    hint: str = ""


@dataclass(frozen=True)
class RestartPolicy:
    """Restart budget and back-off (design §4). One decision: :meth:`verdict`."""

    max_restarts: int = 3
    max_stalled_restarts: int = 2
    backoff: float = 1.0
    backoff_cap: float = 60.0

    def delay(self, restart: int) -> float:
        """Back-off before restart number ``restart`` (1-based): none before the first (one failure is the
        common case, and every second of it is RTO), ``backoff`` before the second, doubling, capped."""
        if restart <= 1:
            return 0.0
        return min(self.backoff_cap, self.backoff * 2 ** (restart - 2))

    def verdict(self, facts: RestartFacts) -> Restart | GiveUp:
        if facts.fatal:
            record = facts.fatal[-1]
            code = record.get("exit_code") if record.get("exit_code") in FATAL_CODES else EXIT_UNRECOVERABLE
            return GiveUp(code, f"a worker says a restart cannot help: {record.get('reason')}",
                          "fix what the message says, then `ckptrun resume --latest` or launch again")
        if facts.load_failure:
            return GiveUp(EXIT_UNRECOVERABLE, "the script failed to load", "fix the script and launch again")
        if facts.first_attempt and not facts.reached_first_step and not facts.snapshot_set_aside:
            # any script: a restart would fail the same way (unless it now starts from another snapshot)
            return GiveUp(EXIT_UNRECOVERABLE, "the first attempt failed before its first step",
                          "a restart would fail the same way; fix the cause and launch again")
        if facts.stalled_restarts >= self.max_stalled_restarts:
            return GiveUp(EXIT_UNRECOVERABLE, f"{facts.stalled_restarts} restarts in a row brought no new snapshot",
                          "the job fails the same way each time; inspect the logs, fix it, then `ckptrun resume --latest`")
        if facts.restarts >= self.max_restarts:
            return GiveUp(EXIT_NO, f"the restart budget is spent ({facts.restarts} of {self.max_restarts})",
                          "inspect the logs, then `ckptrun resume --latest` (or raise --max-restarts)")
        return Restart(self.delay(facts.restarts + 1))
