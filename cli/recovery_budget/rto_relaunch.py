"""The relaunch a restart really runs, timed now with no-op ranks: which path, and its launch → ranks ready.

A restart does not start like a first launch. With ``--standby`` (the default) the next attempt's
torchrun agent was started while the failed attempt trained, and is past its imports when the
supervisor hands it the attempt; with ``--warm-workers`` (the default, when ``--nproc-per-node`` is a
number) that agent forks its ranks past ``import torch`` and the runtime (``runtime/worker/warm_start.py``)
instead of starting a new interpreter per rank. Timing a cold torchrun launch for such a run made the
estimate five times the measured restart. So :func:`noop_attempt` builds the path the supervisor would
take from the run's own options (:func:`relaunch_path`): it pre-starts a standby the supervisor's way
(:class:`~ckptrun.cli.supervision.standby.StandbyKeeper`), waits until it is ready — as it is before a
failure — then times its hand-over → every no-op rank joined the process group, and tears the tree down
with the supervisor's teardown. Importable without torch (torch runs in the children).
"""

from __future__ import annotations

import contextlib
import json
from contextlib import contextmanager
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from ckptrun.cli.errors import CkptrunError
from ckptrun.cli.supervision.attempt import RUN_ID_VARIABLE, WARM_PIDS, AttemptProcess, torchrun_args, torchrun_command
from ckptrun.cli.supervision.spec import LaunchSpec
from ckptrun.cli.supervision.standby import StandbyKeeper
from ckptrun.runtime.env import variable

NOOP_TARGET = ["-m", "ckptrun.cli.recovery_budget.rto_probe", "noop"]
READY_WORD = "ckptrun standby: ready"  # what a standby prints once past its imports (standby.py)


@dataclass(frozen=True)
class RelaunchPath:
    """How the supervisor starts a restart's attempt, from the run's options (run.json, else the defaults)."""

    standby: bool  # a pre-started agent, past its imports, is handed the attempt
    warm: bool  # ranks forked from the agent (torchrun --start-method fork) instead of new interpreters

    @property
    def words(self) -> str:
        agent = "warm standby agent" if self.standby else "fresh torchrun agent"
        ranks = "forked (warm) ranks" if self.warm else "spawned (cold) ranks, a new interpreter each"
        return f"{agent}, {ranks}"

    @property
    def name(self) -> str:
        return "warm" if self.warm else "cold"


def relaunch_path(spec: LaunchSpec | None) -> RelaunchPath:
    """The supervisor's own rule (:attr:`LaunchSpec.forks_ranks`), from the run's options or the defaults."""
    spec = spec if spec is not None else LaunchSpec()
    return RelaunchPath(bool(spec.standby), spec.forks_ranks)


@dataclass(frozen=True)
class NoopTimes:
    launch_s: float  # attempt handed over (or started) → every rank imported and joined the process group
    teardown_s: float  # the supervisor's teardown of that tree
    world: int
    path: RelaunchPath
    opened_store: bool = False  # every no-op rank opened the run's object store (its client), as the run's ranks do


def spec_for(spec: LaunchSpec | None, world: int) -> LaunchSpec:
    """The run's launch options at ``world`` ranks on this node alone, on a fresh standalone rendezvous: a
    many-node run's no-op times one node's relaunch (every node relaunches at once; a rendezvous across the
    job's nodes would wait for launchers that are not there)."""
    base = spec.model_copy() if spec is not None else LaunchSpec()
    base.nproc_per_node, base.master_port = str(world), None
    base.nnodes, base.node_rank, base.rdzv_backend, base.rdzv_endpoint, base.local_addr = "1", 0, None, None, None
    return base


def attempt_command(path: RelaunchPath, spec: LaunchSpec | None, world: int, work: Path, target: list[str]) -> list[str]:
    """The agent command of an attempt running ``target`` on ``world`` ranks, forked ones on the warm path."""
    warm_pids = work / WARM_PIDS if path.warm else None
    return torchrun_command(work / "failures.json", torchrun_args(spec_for(spec, world), work / "logs"), target, warm_pids)


@contextmanager
def relaunched(path: RelaunchPath, run_id: str, command: list[str], env: dict[str, str], work: Path,
               timeout: float) -> Iterator[AttemptProcess]:
    """``command`` started as a restart of this run starts it: handed to a standby that is past its imports
    (as one is when a failure comes: it starts while the run trains), else a fresh agent. The handover (or
    start) is the attempt's ``started``."""
    keeper = StandbyKeeper(path.standby, run_id, work / "standby.log", lambda *_, **__: None, warm=path.warm)
    try:
        if path.standby:
            keeper.prepare({RUN_ID_VARIABLE: run_id})
            _wait_standby(keeper, work / "standby.log", timeout)
        yield keeper.start(1, command, env, work / "console.log", work / WARM_PIDS if path.warm else None)
    finally:
        keeper.close()


def noop_attempt(world: int, spec: LaunchSpec | None, env: dict[str, str], timeout: float = 120.0) -> NoopTimes:
    """Start ``world`` no-op ranks the way a restart of this run would, wait until all are ready, tear down.

    ``env``: the children's environment (without the run id; one is made up so the sweep finds them)."""
    path = relaunch_path(spec)
    run_id = f"rto-noop-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="ckptrun-rto-") as scratch:
        work = Path(scratch)
        env = {**env, RUN_ID_VARIABLE: run_id, variable("run_dir"): str(work / "run")}  # its heartbeats: not in cwd
        command = attempt_command(path, spec, world, work, [*NOOP_TARGET, str(work / "ready")])
        with relaunched(path, run_id, command, env, work, timeout) as attempt:
            try:
                ready = _wait_ready(attempt, work / "ready", world, timeout)  # every rank's ready record
            finally:
                teardown = attempt.teardown(spec.grace_period if spec else 60.0, run_id)
        if ready is None:
            raise CkptrunError(f"a no-op launch of {world} rank(s) ({path.words}) did not start within {timeout:g}s: "
                               f"{tail(work / 'console.log')}",
                               "check that torchrun runs here (python -m torch.distributed.run)")
        return NoopTimes(max(r["time"] for r in ready) - attempt.started, teardown, world, path,
                         all(r.get("store") for r in ready))


def _wait_standby(keeper: StandbyKeeper, log: Path, timeout: float) -> None:
    """Until the standby is past its imports, as it is when a failure comes (it starts while the run trains)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and READY_WORD in log.read_text(errors="replace"):
            return
        if keeper.standby is None or not keeper.standby.waiting():
            break
        time.sleep(0.02)
    raise CkptrunError(f"a standby agent did not get ready within {timeout:g}s: {tail(log)}",
                       "check that torchrun imports here (python -m torch.distributed.run --help)")


def _wait_ready(attempt: Any, ready_dir: Path, world: int, timeout: float) -> list[dict[str, Any]] | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = list(ready_dir.glob("rank-*"))
        if len(files) >= world:
            with contextlib.suppress(OSError, ValueError, KeyError):  # a rank's file half written: read it next poll
                records = [json.loads(f.read_text()) for f in files]
                if all("time" in r for r in records):
                    return records
        if attempt.exit_code() is not None:
            return None
        time.sleep(0.02)
    return None


def tail(path: Path, lines: int = 3) -> str:
    """The last lines of a child's log, on one line, for an error message."""
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no output"
    return " | ".join(text[-lines:]) or "no output"
