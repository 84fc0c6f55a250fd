"""One attempt = one torchrun process tree: start it, find its ranks, signal them, tear it all down.

The tree runs in a session of its own (so a Ctrl-C reaches only the
supervisor) and is started through :mod:`ckptrun.cli.supervision.agent`, which is torchrun
plus a record of per-rank failures. Ranks are torchrun's direct children that
carry ``RANK`` in their environment (a rank forked from torchrun, a warm worker,
has its agent's: it names itself in a pid file instead); data-loader workers and other
grandchildren are found through psutil. Teardown collects the whole tree
*before* signalling (a dying parent orphans its children), sends SIGTERM,
waits the grace period (a second at most once the attempt has failed) and
SIGKILLs survivors; a last sweep finds any process
that still carries the run's id (a SIGKILLed rank's orphaned loader workers).
Importable without torch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Collection, Iterable, Mapping

import psutil

from ckptrun.cli.supervision.fork_fallback import with_cuda_fork_safety
from ckptrun.runtime.env import variable

if TYPE_CHECKING:  # annotations only: the agent process imports this module and must start fast
    from ckptrun.cli.supervision.spec import LaunchSpec

RUN_ID_VARIABLE = variable("run_id")
NODE_VARIABLE = variable("node")
WARM_PIDS = "warm-ranks"  # in an attempt's log dir: one pid file per forked rank (runtime/worker/warm_start.py)
FAILED_GRACE_S = 1.0  # SIGTERM -> SIGKILL for a failed attempt's survivors (they have nothing to save)


def default_job() -> Path:
    """The embedded default training script (``ckptrun.templates.default_job``)."""
    return Path(str(files("ckptrun.templates").joinpath("default_job.py")))


def torchrun_args(spec: LaunchSpec, log_dir: Path) -> list[str]:
    """torchrun's flags for one attempt: a fresh rendezvous unless a fixed port was asked for."""
    args = ["--nproc-per-node", spec.nproc_per_node, "--nnodes", spec.nnodes, "--node-rank", str(spec.node_rank)]
    if spec.master_port is not None:
        args += ["--master-addr", spec.master_addr or "127.0.0.1", "--master-port", str(spec.master_port)]
    elif spec.rdzv_backend or spec.rdzv_endpoint:
        args += [f"--rdzv-backend={spec.rdzv_backend or 'c10d'}", f"--rdzv-endpoint={spec.rdzv_endpoint or 'localhost:0'}"]
    else:
        args += ["--standalone"]
    if spec.local_addr:
        args += ["--local-addr", spec.local_addr]
    return args + ["--log-dir", str(log_dir), "--redirects", "3", "--tee", "3",
                   "--shutdown-timeout", str(max(1, int(spec.grace_period)))]


def torchrun_command(failures_json: Path, torchrun_args: list[str], target: list[str],
                     warm_pids: Path | None = None) -> list[str]:
    """``python -m ckptrun.cli.supervision.agent FAILURES … torchrun args … -m ckptrun.runtime.worker.bootstrap TARGET``;
    with ``warm_pids``, ranks forked from the agent (``--start-method fork``) that run ``runtime/worker/warm_start.py``
    and write their pid files into that directory."""
    start = ["-m", "ckptrun.runtime.worker.bootstrap"] if warm_pids is None else \
        ["--start-method", "fork", "--run-path", str(warm_start_file()), str(warm_pids)]
    return [sys.executable, "-m", "ckptrun.cli.supervision.agent", str(failures_json), *torchrun_args,
            "--max-restarts", "0", *start, *target]


def warm_start_file() -> Path:
    """``runtime/worker/warm_start.py``, the entry of a forked rank (found without importing it)."""
    return Path(str(files("ckptrun.runtime.worker").joinpath("warm_start.py")))


class AttemptProcess:
    """The running torchrun tree of one attempt."""

    def __init__(self, command: list[str], env: Mapping[str, str], console_log: Path, cwd: Path | None = None,
                 popen: subprocess.Popen | None = None, warm_pids: Path | None = None) -> None:
        """Start ``command``, or adopt ``popen``: a standby agent already given this attempt (standby.py).
        ``warm_pids``: the ranks are forked (warm workers) and name themselves in pid files there."""
        console_log.parent.mkdir(parents=True, exist_ok=True)
        if popen is None:
            with open(console_log, "ab") as log:
                popen = subprocess.Popen(command, env=with_cuda_fork_safety(dict(env)), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=cwd, start_new_session=True)
        self.popen = popen
        self.started = time.time()
        self.root = psutil.Process(self.popen.pid)
        self.ranks: dict[int, psutil.Process] = {}
        self.local_world_size: int | None = None
        self.warm_pids = warm_pids

    def exit_code(self) -> int | None:
        """torchrun's exit status once it has ended (negative: killed by that signal)."""
        return self.popen.poll()

    def discover_ranks(self) -> dict[int, psutil.Process]:
        """Find rank processes among torchrun's children (cheap once all are known)."""
        if self.local_world_size is not None and len(self.ranks) >= self.local_world_size:
            return self.ranks
        try:
            children = self.root.children()
        except psutil.Error:
            return self.ranks
        known = {p.pid for p in self.ranks.values()}
        for child in children:
            if child.pid not in known:
                self._adopt(child)
        return self.ranks

    def _adopt(self, child: psutil.Process) -> None:
        if self.warm_pids is not None:  # a forked rank's /proc environ is its agent's: it names itself in a file
            facts = _warm_rank(self.warm_pids, child.pid)
            if facts is not None:
                self.ranks[facts["rank"]] = child
                self.local_world_size = facts["local_world_size"]
                return  # else: a rank spawned after all (fork_fallback.py), or one not yet exec'd or named
        try:
            environ = child.environ()
        except psutil.Error:
            return
        if "RANK" not in environ:  # not exec'd yet: try again on the next poll
            return
        self.ranks[int(environ["RANK"])] = child
        if environ.get("LOCAL_WORLD_SIZE", "").isdigit():
            self.local_world_size = int(environ["LOCAL_WORLD_SIZE"])

    def alive(self, rank: int) -> bool:
        return _running(self.ranks[rank])

    def signal_ranks(self, ranks: Iterable[int], sig: signal.Signals) -> None:
        for rank in ranks:
            process = self.ranks.get(rank)
            if process is not None and _running(process):
                try:
                    process.send_signal(sig)
                except psutil.Error:
                    pass

    def tree(self) -> list[psutil.Process]:
        """torchrun and every descendant, collected now."""
        processes = [self.root, *self.ranks.values()]
        for process in list(processes):
            try:
                processes.extend(process.children(recursive=True))
            except psutil.Error:
                pass
        unique = {p.pid: p for p in processes if p.pid != self.root.pid}
        return list(unique.values())

    def teardown(self, grace: float, run_id: str, failed: bool = False, node: int | Collection[str] | None = None,
                 spare: Collection[int] = ()) -> float:
        """SIGTERM the ranks and torchrun at once, wait up to ``grace``, SIGKILL the rest, sweep by run id
        (and ``node``: only that node's workers, when several nodes share a host — or the node labels a
        promoted spare's ranks carry); returns seconds.

        A ``failed`` attempt (a crash, a hang, a kill) has nothing left to save, and its survivors sit blocked
        in a collective waiting for the lost rank: they get :data:`FAILED_GRACE_S` at most, not the grace
        period a stop needs to save. The ranks are signalled directly, first, not through torchrun.
        """
        grace = min(grace, FAILED_GRACE_S) if failed else grace
        started = time.monotonic()
        others = self.tree()
        for process in others:
            _signal(process, signal.SIGTERM)
        if self.popen.poll() is None:
            _signal(self.root, signal.SIGTERM)
        alive = wait_gone(others, grace)
        try:
            self.popen.wait(timeout=max(0.1, grace - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
        kill_all(alive)
        kill_all([p for p in processes_of_run(run_id, node) if p.pid not in spare])  # spare: the next attempt's standby
        return time.monotonic() - started


def _warm_rank(pid_dir: Path, pid: int) -> dict[str, int] | None:
    """The pid file (``runtime/worker/warm_start.py``) of the forked rank ``pid``, if it has written one."""
    for path in pid_dir.glob("rank-*.json"):
        try:
            facts = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(facts, dict) and facts.get("pid") == pid:
            return {"rank": int(facts["rank"]), "local_world_size": int(facts["local_world_size"])}
    return None


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal(process: psutil.Process, sig: signal.Signals) -> None:
    try:
        process.send_signal(sig)
    except psutil.Error:
        pass


def kill_all(processes: list[psutil.Process], wait: float = 5.0) -> None:
    for process in processes:
        _signal(process, signal.SIGKILL)
    wait_gone(processes, wait)


def wait_gone(processes: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until each process has exited (a zombie counts: it runs nothing); returns those still alive.

    Not psutil.wait_procs: an orphan's zombie waits for init to reap it, which can take a second.
    """
    deadline = time.monotonic() + timeout
    alive = [p for p in processes if _running(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.02)
        alive = [p for p in alive if _running(p)]
    return alive


def processes_of_run(run_id: str, node: int | Collection[str] | None = None) -> list[psutil.Process]:
    """Every live process whose environment carries this run's id, and ``node``'s rank when given — or one
    of the node labels given: a promoted spare's standby started before it had a node rank (never this
    process)."""
    labels = None if node is None else {str(node)} if isinstance(node, int) else set(node)
    found = []
    for process in psutil.process_iter():
        if process.pid == os.getpid():
            continue
        try:
            environ = process.environ()
            if environ.get(RUN_ID_VARIABLE) != run_id or (labels is not None and environ.get(NODE_VARIABLE) not in labels):
                continue
            if process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except psutil.Error:
            continue
    return found
