"""A warm standby agent: the next attempt's torchrun process, started and past its imports before it is needed.

Starting an attempt's agent (a new interpreter importing ``torch.distributed.run``)
was the largest piece of a restart after the workers' own start-up. While
attempt N trains, the supervisor starts attempt N+1's agent as
``python -m ckptrun.cli.supervision.standby RUN_ID [--warm]``: it imports torchrun and the agent (with
``--warm``, for warm workers, the runtime too: the ranks it forks inherit every import), then blocks
on one JSON line on its stdin — the *go* — carrying all that is
attempt-specific: the agent's argv (failures file, torchrun flags with a fresh
rendezvous, the target), the whole environment (C1: attempt number, the
snapshot the supervisor chose and verified, …), the working directory and the
attempt's console log. On *go* it takes them on and runs
:func:`ckptrun.cli.supervision.agent.main`, exactly as a freshly started agent
would. The supervisor still tears attempt N down, counts the restart and
verifies the snapshot first; the standby only skips the start-up.

Of the run's C1 environment a standby carries, from its start, only the run's identity (run id and node):
a forked rank's ``/proc`` environment is the one its agent was started with, and the teardown's sweep
finds a run's processes by that identity. The sweep of attempt N spares the standby waiting for N+1
(:meth:`StandbyKeeper.waiting_pids`).

No orphans: the go pipe's only writer is the supervisor, so when the
supervisor dies (even SIGKILLed) the standby reads end-of-file and exits; after
*go* the agent watches the supervisor as always. A standby that is not used is
killed (:meth:`Standby.dismiss`) at the end of the run. Nothing of it is shared
between nodes: each node's supervisor keeps its own, and torchrun's shared
worker store is never used. The supervisor side is importable without torch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import psutil

from ckptrun.cli.supervision.attempt import AttemptProcess
from ckptrun.cli.supervision.fork_fallback import CUDA_FORK_SAFE, with_cuda_fork_safety
from ckptrun.runtime.env import PREFIX

AGENT_MODULE = "ckptrun.cli.supervision.agent"
STANDBY_MODULE = "ckptrun.cli.supervision.standby"


class Standby:
    """The supervisor's handle on one pre-started agent process (see the module docstring)."""

    def __init__(self, env: Mapping[str, str], log: Path, run_id: str, cwd: Path | None = None, warm: bool = False) -> None:
        log.parent.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", STANDBY_MODULE, run_id, *(["--warm"] if warm else [])]  # the run id names it
        with open(log, "ab") as stream:
            self.popen = subprocess.Popen(argv, env=with_cuda_fork_safety(dict(env)), stdin=subprocess.PIPE, stdout=stream,
                                          stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True)
        self.started = time.time()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def waiting(self) -> bool:
        """Still there to be used (a standby that died, e.g. on a broken import, is not)."""
        return self.popen.poll() is None

    def go(self, command: list[str], env: Mapping[str, str], console_log: Path, cwd: Path | None = None) -> subprocess.Popen:
        """Hand over the attempt: ``command`` is the agent command a fresh start would run. Returns the process."""
        if command[1:3] != ["-m", AGENT_MODULE]:
            raise ValueError(f"not an agent command: {command[:3]}")
        word = {"argv": command[3:], "env": with_cuda_fork_safety(dict(env)), "console_log": str(console_log),
                "cwd": str(cwd) if cwd is not None else None}
        assert self.popen.stdin is not None
        self.popen.stdin.write((json.dumps(word) + "\n").encode())
        self.popen.stdin.close()  # the only word it gets
        return self.popen

    def dismiss(self) -> None:
        """Kill an unused standby (it holds nothing: no ranks, no store) and reap it."""
        if self.popen.stdin is not None and not self.popen.stdin.closed:
            self.popen.stdin.close()
        if self.popen.poll() is None:
            try:
                self.popen.send_signal(signal.SIGKILL)
            except OSError:
                pass
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


class StandbyKeeper:
    """One node's standby: pre-started once an attempt trains, used by the next launch, dismissed at the end."""

    def __init__(self, enabled: bool, run_id: str, log: Path, event: Callable[..., None], warm: bool = False) -> None:
        self.enabled, self.run_id, self.log, self.event, self.warm = enabled, run_id, log, event, warm
        self.standby: Standby | None = None

    def prepare(self, identity: Mapping[str, str]) -> None:
        """Pre-start the next attempt's agent unless one waits already (called once the attempt trains, so
        that its imports do not compete with the attempt's own start-up). ``identity``: the run id and node
        variables of C1, all of it the standby carries until its word."""
        if self.enabled and self.standby is None:
            env = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}
            env.update({**identity, "PYTHONUNBUFFERED": env.get("PYTHONUNBUFFERED") or "1"})
            self.standby = Standby(env, self.log, self.run_id, warm=self.warm)

    def take_over(self, earlier: "StandbyKeeper") -> None:
        """Use the standby another keeper started (a promoted spare's, warm since the spare joined) for the next
        launch; one that would fork its ranks otherwise than this run does is dismissed."""
        if self.enabled and self.standby is None and earlier.standby is not None and earlier.warm == self.warm:
            self.standby, earlier.standby = earlier.standby, None
        earlier.close()

    def waiting_pids(self) -> set[int]:
        """The standby waiting for the next attempt: an attempt's teardown must not sweep it."""
        return {self.standby.pid} if self.standby is not None else set()

    def start(self, attempt: int, command: list[str], env: Mapping[str, str], console_log: Path,
              warm_pids: Path | None = None) -> AttemptProcess:
        """The attempt's process tree: the waiting standby given its word, else a fresh agent (``warm_pids``:
        see :class:`AttemptProcess`)."""
        standby, self.standby = self.standby, None
        if standby is not None and standby.waiting():
            console_log.parent.mkdir(parents=True, exist_ok=True)
            try:
                popen = standby.go(command, env, console_log)
            except OSError:  # it died just now: start afresh
                standby.dismiss()
            else:
                self.event("standby_used", attempt=attempt, pid=popen.pid, waited_s=round(time.time() - standby.started, 3))
                return AttemptProcess(command, env, console_log, popen=popen, warm_pids=warm_pids)
        elif standby is not None:
            standby.dismiss()
        return AttemptProcess(command, env, console_log, warm_pids=warm_pids)

    def close(self) -> None:
        """The run is over (or the supervisor is leaving): no standby outlives it."""
        if self.standby is not None:
            self.standby.dismiss()
            self.standby = None


# --- the standby process -------------------------------------------------------------------


def _take_over(word: dict[str, Any]) -> None:
    """Become the attempt's agent: its log on stdout/stderr, its environment, its working directory."""
    log = os.open(word["console_log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    null = os.open(os.devnull, os.O_RDONLY)  # as a fresh agent's: torchrun's workers inherit it
    os.dup2(null, 0)
    os.close(null)
    os.environ.clear()
    os.environ.update(word["env"])
    if word.get("cwd"):
        os.chdir(word["cwd"])


def main(argv: list[str]) -> int:
    started = psutil.Process().create_time()
    os.environ.update(CUDA_FORK_SAFE)  # whatever it imports asks NVML, never the CUDA driver: it forks ranks
    # The costly part, done before the word: torchrun (and with it torch) and the agent.
    import torch.distributed.run  # noqa: F401
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: F401

    from ckptrun.cli.supervision import agent

    if "--warm" in argv:  # the ranks are forked from here: the runtime a script imports, loaded once for all
        agent.warm_imports()
    print(f"ckptrun standby: ready {time.time() - started:.2f}s after its start", flush=True)

    line = sys.stdin.readline()
    if not line.strip():
        return 0  # end of file: the supervisor is gone, or dismissed this standby
    word = json.loads(line)
    Path(word["console_log"]).parent.mkdir(parents=True, exist_ok=True)
    _take_over(word)
    return agent.main(word["argv"])


if __name__ == "__main__":
    from ckptrun.cli.supervision.agent import leave

    leave(main(sys.argv[2:]))
