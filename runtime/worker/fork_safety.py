"""What a rank forked from its agent (a warm worker) checks and undoes before the script runs.

A forked process inherits more than a fresh interpreter would have, and three inheritances bite:

* **CUDA.** A process that forks after CUDA was initialised leaves its child unable to use CUDA
  (``torch.cuda._is_in_bad_fork()``; the first CUDA call raises "Cannot re-initialize CUDA in forked
  subprocess"). The agent runs with ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` so that torchrun's own
  ``torch.cuda.is_available()`` (``LaunchConfig.__post_init__``) does not initialise it, and nothing of
  ckptrun's touches ``torch.cuda`` there. Should anything still have done it, the rank does not fail the run:
  it writes :data:`BAD_FORK_FILE` in its pid directory and exits with :data:`BAD_FORK_EXIT` before the
  script starts; the agent (``cli/supervision/fork_fallback.py``) runs the attempt again with spawned ranks
  and the run keeps spawning. The check reads a flag; it initialises nothing.
* **Listening sockets.** The agent's rendezvous store listens on a port; a rank that kept that socket
  (an orphan, say) would keep the port bound after its agent is gone. The rank closes every inherited
  listening socket (it listens on none of its own yet).
* **Thread pools.** libgomp and OpenBLAS read their thread counts when the agent loaded them, before torchrun
  set ``OMP_NUM_THREADS`` for the rank: torch's count is set by ``warm_start.apply_threads``, numpy's
  OpenBLAS/MKL pool here through ``threadpoolctl`` when installed, else OpenBLAS's own C call.

Importable without torch (torch is imported only by the checks that need it, already loaded in a warm rank).
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import stat
import sys
from pathlib import Path

from ckptrun.runtime.env import EnvError, RunEnv
from ckptrun.runtime.faults import FaultSpecError, parse_faults

BAD_FORK_FILE = "bad-fork-rank-{rank}.json"  # in the attempt's pid dir: this rank found CUDA poisoned
BAD_FORK_GLOB = "bad-fork-rank-*.json"
BAD_FORK_EXIT = 75  # EX_TEMPFAIL: the agent runs the attempt again with spawned ranks (never a restart)


def _fault_says_bad_fork() -> bool:
    """Test only: C1's ``bad-fork`` fault makes this rank see a poisoned CUDA (a patch that reaches the fork)."""
    try:
        env = RunEnv.from_env()
        faults = parse_faults(env.fault)
    except (EnvError, FaultSpecError):
        return False
    rank = int(os.environ.get("RANK", "0"))
    return any(f.kind == "bad-fork" and f.applies(rank, env.attempt) for f in faults)


def cuda_poisoned() -> bool:
    """Whether this forked process may not use CUDA (``torch.cuda._is_in_bad_fork()``: a flag, no CUDA call).
    A process without torch loaded was not forked from an agent that could have initialised CUDA."""
    if "torch" not in sys.modules:
        return False
    import torch.cuda

    if _fault_says_bad_fork():
        torch.cuda._is_in_bad_fork = lambda: True  # type: ignore[attr-defined]
    return bool(torch.cuda._is_in_bad_fork())


def leave_for_spawn(pid_dir: Path) -> None:
    """Tell the agent that this rank cannot use CUDA after the fork and leave before the script starts."""
    rank = int(os.environ.get("RANK", "0"))
    path = pid_dir / BAD_FORK_FILE.format(rank=rank)
    pid_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps({"rank": rank, "pid": os.getpid()}))
    tmp.replace(path)
    print(f"ckptrun: rank {rank}: CUDA was initialised in the agent before it forked this rank; "
          "the attempt restarts with spawned ranks", file=sys.stderr, flush=True)
    os._exit(BAD_FORK_EXIT)


def _listening(fd: int) -> bool:
    """Whether ``fd`` is a listening socket. Only sockets are probed, through a duplicate that is always closed:
    a leaked duplicate of another descriptor (the agent's sentinel pipe to this rank, say) would outlive this
    rank in its data-loader workers and hide its death from torchrun."""
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            return False
        duplicate = os.dup(fd)
    except OSError:
        return False
    try:
        probe = socket.socket(fileno=duplicate)
    except OSError:
        os.close(duplicate)
        return False
    try:
        return bool(probe.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
    except OSError:
        return False
    finally:
        probe.close()


def close_inherited_listeners() -> list[int]:
    """Close every listening socket this process inherited (its agent's); returns their descriptors."""
    closed = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and _listening(fd):
            os.close(fd)
            closed.append(fd)
    return closed


def limit_blas_threads(count: int) -> None:
    """numpy's BLAS pool to ``count`` threads, as a cold start under this ``OMP_NUM_THREADS`` would have it."""
    if "numpy" not in sys.modules:
        return  # loaded later, by the rank itself: it reads the environment then
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        _openblas_threads(count)
        return
    threadpool_limits(limits=count, user_api="blas")


SETTERS = ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_", "openblas_set_num_threads")
GETTERS = ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_", "openblas_get_num_threads")


def _openblas_libraries() -> list[ctypes.CDLL]:
    """The OpenBLAS libraries this process has loaded (numpy's bundled copy)."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "openblas" in line.rsplit("/", 1)[-1].lower()}
    found = []
    for path in sorted(paths):
        try:
            found.append(ctypes.CDLL(path))
        except OSError:
            continue
    return found


def _call_first(library: ctypes.CDLL, symbols: tuple[str, ...], *args: ctypes.c_int) -> int | None:
    for symbol in symbols:
        function = getattr(library, symbol, None)
        if function is not None:
            return int(function(*args) or 0)
    return None


def _openblas_threads(count: int) -> None:
    """OpenBLAS's own setter, in every copy this process has loaded."""
    for library in _openblas_libraries():
        _call_first(library, SETTERS, ctypes.c_int(count))


def openblas_threads() -> list[int]:
    """The thread count of each OpenBLAS copy loaded here (what :func:`limit_blas_threads` set)."""
    counts = [_call_first(library, GETTERS) for library in _openblas_libraries()]
    return [c for c in counts if c is not None]
