"""Warm workers that cannot use CUDA: the agent runs the attempt again with spawned ranks, and the run keeps them.

A rank forked from an agent that had initialised CUDA cannot use it (``runtime/worker/fork_safety.py``).
The agent never initialises it (:data:`CUDA_FORK_SAFE`: torchrun's ``torch.cuda.is_available()`` then
asks NVML, not the CUDA driver), but a user's ``sitecustomize``, a plugin or a later torch might. Then
each forked rank leaves at once, before the script, with a file in the attempt's pid directory; when
torchrun gives up, the agent finds those files and, instead of failing the attempt (before its first
step: a failure a restart "cannot fix", exit 4), says so in one line on stderr, logs a
``warm_workers_off`` event and runs torchrun again in the same attempt with spawned ranks (a new
interpreter each: ``-m ckptrun.runtime.worker.bootstrap``). The supervisor reads that event and starts
every later attempt of the run with spawned ranks (:func:`warm_workers_refused`). No restart is counted
and no step was lost: the ranks had not started the script.

Many nodes: each node's agent falls back on its own; the fallback rendezvous gets a new id
(``<id>-spawned``) so that nodes that fell back meet in it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from ckptrun.runtime import records
from ckptrun.runtime.env import EnvError, RunEnv
from ckptrun.runtime.worker.fork_safety import BAD_FORK_GLOB

CUDA_FORK_SAFE = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}  # torch/cuda/__init__.py: is_available() without cuInit
EVENT = "warm_workers_off"
SPAWN_START = ["-m", "ckptrun.runtime.worker.bootstrap"]
RDZV_ID_VARIABLE = "PET_RDZV_ID"  # torchrun's own name (many nodes set the rendezvous id this way)


def with_cuda_fork_safety(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a process that imports torch and forks ranks (an agent, a standby)."""
    return {**env, **CUDA_FORK_SAFE}


def bad_fork_ranks(pid_dir: Path) -> list[int]:
    """The ranks of this attempt that found CUDA poisoned after their fork."""
    ranks = []
    for path in pid_dir.glob(BAD_FORK_GLOB):
        try:
            ranks.append(int(json.loads(path.read_text())["rank"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(ranks)


def spawn_args(torchrun_args: list[str]) -> list[str]:
    """The same torchrun flags with spawned ranks: ``--start-method fork --run-path WARM PID_DIR`` becomes
    ``-m ckptrun.runtime.worker.bootstrap``; a fixed rendezvous id gets a new one."""
    at = torchrun_args.index("--run-path")
    args = [a for a in torchrun_args[:at] if a not in ("--start-method", "fork")] + SPAWN_START + torchrun_args[at + 3:]
    out = []
    for index, arg in enumerate(args):
        if index and args[index - 1] == "--rdzv-id":
            arg = f"{arg}-spawned"
        elif arg.startswith("--rdzv-id="):
            arg = f"{arg}-spawned"
        out.append(arg)
    if os.environ.get(RDZV_ID_VARIABLE):
        os.environ[RDZV_ID_VARIABLE] += "-spawned"
    return out


def announce(ranks: list[int]) -> None:
    """The one line on stderr and the event the supervisor reads."""
    print(f"ckptrun: ranks {', '.join(map(str, ranks))} could not use CUDA after the fork: this attempt again with "
          "spawned ranks", file=sys.stderr, flush=True)
    try:
        env = RunEnv.from_env()
    except EnvError:
        return
    if env.run_dir is not None and "run_dir" in env.model_fields_set:
        records.log_event(env.run_dir, EVENT, attempt=env.attempt, ranks=ranks,
                          reason="CUDA initialised in the agent before it forked the ranks")


def fallback_line(event: dict[str, Any]) -> str:
    """What the supervisor says when it reads the event (the user's terminal; the agent's line is in the log)."""
    return (f"warning: attempt {event.get('attempt')}: the forked ranks could not use CUDA (initialised in the agent "
            "before the fork); they run as new processes for the rest of this run (as with --no-warm-workers)")


def warm_workers_refused(run_dir: Path) -> bool:
    """Whether a warm rank of this run found CUDA poisoned: later attempts spawn their ranks."""
    return bool(records.read_events(run_dir, EVENT))
