"""What the supervisor's state machine works on: an attempt's states, what one poll observes, the
:class:`World` it acts through, stop requests and how a run ends.

Plain data and one Protocol, apart from the machine (:mod:`ckptrun.cli.supervision.supervisor`) so that
the world that implements them (:mod:`ckptrun.cli.supervision.world`), the pure policies and the tests
that script observations share one vocabulary without importing the loop. Importable without torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ckptrun.cli.supervision.failures import RankFailure
from ckptrun.runtime.records import Heartbeat


class State(str, enum.Enum):
    STARTING = "starting"
    HEALTHY = "healthy"
    STALLED = "stalled"
    FAILED = "failed"
    SUCCEEDED = "succeeded"
    STOPPING = "stopping"
    STOPPED = "stopped"


@dataclass(frozen=True)
class RankView:
    """One rank as seen in one poll: is its process alive, and its heartbeat of this attempt."""

    alive: bool
    beat: Heartbeat | None = None


@dataclass
class Observation:
    """What one poll of the world sees."""

    time: float
    ranks: dict[int, RankView] = field(default_factory=dict)
    agent_exit: int | None = None  # torchrun's exit code once it ended
    first_step_time: float | None = None  # wall time of this attempt's first metrics record
    last_step: int | None = None  # newest step in this attempt's metrics
    last_step_time: float | None = None
    stop_file: bool = False  # RUN_DIR/stop exists (e.g. `ckptrun stop`)
    steps: list[dict[str, Any]] = field(default_factory=list)  # this attempt's step records since the last poll
    snapshot_step: int | None = None  # newest snapshot this attempt saved
    rto_estimate: dict[str, Any] | None = None  # an estimate asked for with request_estimate, once it is done


@dataclass(frozen=True)
class Snapshot:
    """A snapshot the world verified, and how long verifying took."""

    path: Path
    step: int
    verify_s: float = 0.0


class World(Protocol):
    """The supervisor's inputs and effects (see :class:`ckptrun.cli.supervision.world.LocalWorld`)."""

    def now(self) -> float: ...
    def sleep(self, seconds: float) -> None: ...
    def launch(self, attempt: int, resume_from: Path | None) -> None: ...
    def observe(self) -> Observation: ...
    def failures(self) -> tuple[list[RankFailure], str | None]: ...
    def fatal_records(self) -> list[dict[str, Any]]: ...
    def attempt_events(self, name: str) -> list[dict[str, Any]]: ...
    def dump_stacks(self, ranks: list[int]) -> dict[int, str]: ...
    def teardown(self, failed: bool = False) -> float: ...
    def newest_snapshot(self) -> Snapshot | None: ...
    def newest_step(self) -> int | None: ...
    def restart_snapshot(self) -> Snapshot | None: ...
    def quarantine(self, snapshot: Path, status: str, reason: str) -> Path: ...
    def abandon_after(self, snapshot: Path | None) -> list[Path]: ...
    def request_stop(self) -> None: ...
    def terminate_ranks(self) -> None: ...
    def request_estimate(self, backoff_s: float) -> None: ...
    def late_steps(self) -> list[dict[str, Any]]: ...
    def stop_file_present(self) -> bool: ...
    def event(self, name: str, **fields: Any) -> None: ...
    def say(self, line: str) -> None: ...
    def show_progress(self, attempt: int, restarts: int, observation: Observation, recovery: dict[str, Any]) -> None: ...


@dataclass
class StopControl:
    """Stop requests from outside the loop: signals (set by handlers) and the time limit."""

    signals: int = 0
    signal_name: str | None = None
    stop_at: float | None = None  # wall time at which to ask for a stop (time limit minus grace)

    def reason(self, now: float, stop_file: bool) -> str | None:
        if self.signals:
            return f"signal {self.signal_name or ''}".strip()
        if self.stop_at is not None and now >= self.stop_at:
            return "time limit"
        return "stop requested (RUN_DIR/stop)" if stop_file else None

    @property
    def forced(self) -> bool:
        return self.signals >= 2


@dataclass
class Outcome:
    """How supervise() ended: the exit code and what to tell a person."""

    code: int
    message: str
    hint: str | None = None
    attempts: int = 0
    restarts: int = 0


@dataclass
class AttemptWatch:
    """The mutable facts of the attempt being watched."""

    attempt: int
    launched: float
    resume: Snapshot | None
    state: State = State.STARTING
    gone_at: float | None = None  # first poll that saw a rank process gone
    beats: dict[int, Heartbeat] = field(default_factory=dict)
    first_step_time: float | None = None
    first_step: int | None = None  # the attempt's first step record (a plain script's: the optimizer's own count)
    last_step: int | None = None
    last_step_time: float | None = None
    kill_deadline: float | None = None
    failure: dict[str, Any] | None = None
    detected_at: float | None = None
    teardown_s: float = 0.0
    forced: bool = False
    reshard_checked: bool = False  # looked for the attempt's `resharded` event (once, at its first steps)
