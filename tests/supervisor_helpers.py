"""A scripted world for the supervisor's unit tests: observations, failures and snapshots per attempt, no processes.

:class:`ScriptedNodeWorld` is one node of a many-node job: the same scripted attempts, plus what the job's
decisions (:class:`~ckptrun.cli.supervision.node_agent.NodeJob`) read from a node's world and a real store."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ckptrun.cli.supervision.failures import RankFailure
from ckptrun.cli.supervision.job_store import JobStore, NodeWatch
from ckptrun.cli.supervision.memory_tier import MemoryDir
from ckptrun.cli.supervision.node_agent import NodeJob
from ckptrun.cli.supervision.observation import Observation, RankView, Snapshot, StopControl
from ckptrun.cli.supervision.policy import RestartPolicy, Timeouts
from ckptrun.cli.supervision.recovery import RecoveryOptions
from ckptrun.cli.supervision.supervisor import Supervisor
from ckptrun.runtime.records import Heartbeat

T0 = 1000.0


def beat(rank: int, step: int, time: float, phase: str = "train", attempt: int = 1, source: str = "runtime") -> Heartbeat:
    return Heartbeat(rank=rank, pid=100 + rank, attempt=attempt, step=step, phase=phase, time=time, source=source)


def training(time: float, step: int, ranks: int = 2, first_step: float | None = T0 + 3, **kw: Any) -> Observation:
    views = {r: RankView(True, beat(r, step, time - 0.5)) for r in range(ranks)}
    return Observation(time=time, ranks=views, first_step_time=first_step, last_step=step, last_step_time=time - 0.5, **kw)


@dataclass
class ScriptedWorld:
    """A world whose observations, failures and snapshots are scripted per attempt."""

    script: dict[int, list[Observation]]
    failures_by_attempt: dict[int, list[RankFailure]] = field(default_factory=dict)
    events_by_attempt: dict[int, dict[str, list[dict[str, Any]]]] = field(default_factory=dict)
    snapshots: list[Snapshot | None] = field(default_factory=list)
    fatal: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    stop_signal_after: tuple[int, int] | None = None  # (attempt, poll index): a signal arrives then
    stop: StopControl | None = None
    clock: float = T0
    attempt: int = 0
    poll: int = 0
    launches: list[tuple[int, Path | None]] = field(default_factory=list)
    logged: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    said: list[str] = field(default_factory=list)
    teardowns: int = 0
    failed_teardowns: int = 0  # teardowns of an attempt that had already failed (the short SIGKILL grace)
    dumped: list[list[int]] = field(default_factory=list)
    stop_requests: int = 0
    terminated: int = 0  # terminate_ranks() calls (a plain script's stop)
    shown: list[dict[str, Any]] = field(default_factory=list)
    estimates_requested: list[tuple[int, float]] = field(default_factory=list)
    quarantined: list[tuple[Path, str, str]] = field(default_factory=list)
    abandoned: list[Path | None] = field(default_factory=list)
    abandoned_paths: list[Path] = field(default_factory=list)  # what abandon_after reports as moved

    def now(self) -> float:
        return self.clock

    def sleep(self, seconds: float) -> None:
        self.clock += seconds

    def launch(self, attempt: int, resume_from: Path | None) -> None:
        self.attempt, self.poll = attempt, 0
        self.launches.append((attempt, resume_from))

    def observe(self) -> Observation:
        observations = self.script[self.attempt]
        obs = observations[min(self.poll, len(observations) - 1)]
        if self.stop_signal_after == (self.attempt, self.poll) and self.stop:
            self.stop.signals += 1
        self.poll += 1
        self.clock = max(self.clock, obs.time)
        return obs

    def failures(self) -> tuple[list[RankFailure], str | None]:
        return self.failures_by_attempt.get(self.attempt, []), None

    def fatal_records(self) -> list[dict[str, Any]]:
        return self.fatal.get(self.attempt, [])

    def attempt_events(self, name: str) -> list[dict[str, Any]]:
        return self.events_by_attempt.get(self.attempt, {}).get(name, [])

    def dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        self.dumped.append(ranks)
        return {r: STACK_IN_SCRIPT if r == 0 else STACK_IN_TORCH for r in ranks}

    def teardown(self, failed: bool = False) -> float:
        self.teardowns += 1
        self.failed_teardowns += failed
        return 0.5

    def newest_snapshot(self) -> Snapshot | None:
        return self.snapshots.pop(0) if self.snapshots else None

    restart_snapshot = newest_snapshot  # no memory tier in a scripted world

    def newest_step(self) -> int | None:
        snapshot = self.newest_snapshot()
        return snapshot.step if snapshot else None

    def quarantine(self, snapshot: Path, status: str, reason: str) -> Path:
        self.quarantined.append((snapshot, status, reason))
        return snapshot.parent / "quarantine" / "x" / snapshot.name

    def abandon_after(self, snapshot: Path | None) -> list[Path]:
        self.abandoned.append(snapshot)
        return self.abandoned_paths

    def request_stop(self) -> None:
        self.stop_requests += 1

    def terminate_ranks(self) -> None:
        self.terminated += 1

    def stop_file_present(self) -> bool:
        return False

    def event(self, name: str, **fields: Any) -> None:
        self.logged.append((name, fields))

    def say(self, line: str) -> None:
        self.said.append(line)

    def show_progress(self, attempt: int, restarts: int, observation: Observation, recovery: dict[str, Any]) -> None:
        self.shown.append(recovery)

    def late_steps(self) -> list[dict[str, Any]]:
        return []

    def request_estimate(self, backoff_s: float) -> None:
        self.estimates_requested.append((self.attempt, backoff_s))

    def events(self, name: str) -> list[dict[str, Any]]:
        return [fields for event, fields in self.logged if event == name]


@dataclass
class ScriptedNodeWorld(ScriptedWorld):
    """Node ``node`` of a job of ``nodes``: scripted attempts, the job's store real (no ranks, no torchrun)."""

    job: JobStore | None = None
    node: int = 0
    nodes: list[int] = field(default_factory=lambda: [0, 1])
    min_nodes: int = 2
    abandoned_ranks: int = 0  # abandon() calls: the leader was lost

    def __post_init__(self) -> None:
        self.active = list(self.nodes)
        self.settings = SimpleNamespace(leader=self.node == 0, min_nodes=self.min_nodes, spare=None)
        self.spec = SimpleNamespace(allow_reshard=False, node_cache_dir=None)  # no --local-cache
        self.memory = MemoryDir(None)  # no memory tier: nothing to tell the leader after a teardown
        self.memory_fetch: dict = {}
        self.spares = None  # no spare launchers
        self.ckpt_dir, self.run_id = Path("/nonexistent"), "scripted"
        self.watch = NodeWatch(5.0)

    def abandon(self) -> None:
        self.abandoned_ranks += 1


STACK_IN_SCRIPT = """Thread 0x1 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 327 in wait

Current thread 0x2 (most recent call first):
  File "/w/runtime/step/session.py", line 98 in _fire
  File "/w/train.py", line 77 in <module>
  File "<frozen runpy>", line 198 in _run_module_as_main
"""
STACK_IN_TORCH = """Current thread 0x2 (most recent call first):
  File "/v/site-packages/torch/autograd/graph.py", line 979 in _engine_run_backward
  File "/w/train.py", line 77 in <module>
"""

TIMEOUTS = Timeouts(heartbeat=5.0, startup=60.0, save=120.0, grace=30.0, poll=0.2)


def supervisor(world: ScriptedWorld, max_restarts: int = 3, stop: StopControl | None = None,
               recovery: RecoveryOptions | None = None, **kw: Any) -> Supervisor:
    stop = stop or StopControl()
    world.stop = stop
    return Supervisor(world, RestartPolicy(max_restarts, backoff=1.0, backoff_cap=4.0), TIMEOUTS, stop, recovery=recovery, **kw)


def node_supervisor(world: ScriptedNodeWorld, max_restarts: int = 3, join_timeout: float = 20.0) -> Supervisor:
    """The one loop with the many-node job's decisions (leader or follower, as ``world.node`` says)."""
    stop = StopControl()
    world.stop = stop
    job = NodeJob(world, TIMEOUTS, stop, join_timeout)  # type: ignore[arg-type]  # a scripted NodeWorld
    return Supervisor(world, RestartPolicy(max_restarts, backoff=1.0, backoff_cap=4.0), TIMEOUTS, stop, job=job)
