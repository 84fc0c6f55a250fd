"""The entry of a *warm* worker: a rank forked from its torchrun agent, already past ``import torch``.

A restart's largest cost was each rank's own start-up: a new interpreter, ``import torch``, the
runtime's imports. With warm workers (``ckptrun launch --warm-workers``, the default) the agent (a
warm standby, or the first attempt's fresh agent) has imported all of that, and torchrun starts the
ranks with ``--start-method fork --run-path`` this file: torch's own ``MultiprocessContext`` forks
each rank, sets its environment (``RANK``, ``TORCHELASTIC_ERROR_FILE``, …) in ``os.environ``,
redirects its output to the rank's log files and calls this file, which runs
:func:`ckptrun.runtime.worker.bootstrap.main` exactly as a cold worker would.

A forked process is not a fresh interpreter, so before the script runs this makes it look like one:

* **Found by the supervisor.** ``/proc/PID/environ`` of a forked process is its parent's exec-time
  environment: no ``RANK`` there. Each rank writes ``PID_DIR/rank-<RANK>.json`` (its pid, its local
  world size) first thing; the supervisor adopts ranks from those files (``attempt.py``).
* **CUDA usable, or spawned instead.** First of all the rank checks ``torch.cuda._is_in_bad_fork()``
  (:mod:`fork_safety`): if its agent initialised CUDA, it leaves at once and the agent spawns the
  ranks instead. A rank that may use CUDA binds ``LOCAL_RANK``'s GPU, as ``init()`` does.
* **No inherited listening sockets.** The agent's rendezvous socket is closed in the rank.
* **Same threads as a cold start.** libgomp and OpenBLAS read ``OMP_NUM_THREADS`` when the agent loaded
  torch and numpy, before torchrun set it (``1`` per rank when several share a node): the rank applies
  the value its environment holds now to torch (``torch.set_num_threads``) and to numpy's BLAS. The agent
  never runs a parallel region, so no OpenMP pool exists to be inherited.
* **Signals as Python's defaults.** The agent's Python handlers (torchrun's SIGTERM/SIGINT/…
  handlers) would turn a SIGTERM into an exception; they are reset (SIGINT to ``KeyboardInterrupt``).
* **No inherited exit handlers.** The agent's ``atexit`` handlers are dropped; those the script
  registers run when it ends, as at an interpreter's exit (a forked process leaves with
  ``os._exit``).
* **Failures in ckptrun's own error file.** The bootstrap writes ``TORCHELASTIC_ERROR_FILE`` (with
  ``ckptrun_phase``); torch's ``@record`` around this entry would overwrite it, so an uncaught
  exception leaves here as ``SystemExit(1)`` after its traceback is printed.
* **``sys.exit(None)`` is a return.** ``sys.exit(main())`` with a ``main()`` that returns None ends the
  script as a return would (torch's ``record()`` takes only ``SystemExit(0)`` for one).
* **os._exit(0) counts as success.** torch's fork start waits for each rank's return value; a script
  (or the runtime's quiet exit) that leaves with ``os._exit(0)`` posts it first, or the agent would
  wait forever.
* **A rank's death is seen at once.** The agent learns that a forked rank exited when the write end of
  a pipe the rank holds closes (multiprocessing's sentinel). A process the rank forks in turn (a
  DataLoader worker) would hold it too, and the agent would not see a killed rank until its orphaned
  loader workers noticed (seconds): every process forked from a rank closes it first.

The two torch/multiprocessing handles these need (the rank's return queue, its sentinel) are locals of
the frames that forked and called it; when a later version names them otherwise, the rank runs without
that fix and says so on stderr.

Usage (what torchrun runs): ``warm_start.py PID_DIR (SCRIPT | -m MODULE) [ARGS...]``.
"""

from __future__ import annotations

import contextlib
import atexit
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any, Callable

from ckptrun.runtime.worker import fork_safety, timeline
from ckptrun.runtime.worker.user_traceback import print_user_exception

RETURN_QUEUE = ("_wrap", "ret_val_")  # torch.distributed.elastic.multiprocessing.api._wrap: this rank's return queue
SENTINEL = ("_launch", "child_w")  # multiprocessing.popen_fork.Popen._launch: the write end the agent watches


def pid_file(pid_dir: Path, rank: int) -> Path:
    return pid_dir / f"rank-{rank}.json"


def note_pid(pid_dir: Path) -> None:
    """Write this rank's pid file (tmp + rename: the supervisor never reads half of one)."""
    pid_dir.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ["RANK"])
    path = pid_file(pid_dir, rank)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps({"rank": rank, "pid": os.getpid(),
                               "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                               "error_file": os.environ.get("TORCHELASTIC_ERROR_FILE")}))
    tmp.replace(path)


def reset_signals() -> None:
    """Python's own defaults for every signal the agent gave a Python handler (C handlers, e.g. faulthandler's, stay)."""
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (ValueError, OSError):
            continue
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


def apply_threads() -> None:
    """The intra-op thread counts a cold start would have: ``OMP_NUM_THREADS`` as the environment holds it now,
    for torch and for numpy's BLAS."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    if value.isdigit() and int(value) > 0:
        import torch

        torch.set_num_threads(int(value))
        fork_safety.limit_blas_threads(int(value))


def bind_local_device() -> None:
    """``LOCAL_RANK``'s GPU current in this rank (never in the agent; a fork does not carry it over). Only where
    the agent had imported torch: a rank that imports it itself is a cold start, and ``init()`` binds it."""
    if "torch" not in sys.modules:
        return
    import torch.cuda

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available() and local_rank < torch.cuda.device_count():
        torch.cuda.set_device(local_rank)


def reseed_numpy() -> None:
    """numpy's global generator was seeded once, in the agent: every rank would draw the same numbers."""
    random = sys.modules.get("numpy.random")
    if random is not None:
        random.seed()


def caller_local(function: str, name: str) -> Any:
    """Local ``name`` of the nearest calling frame of ``function`` (None when there is none)."""
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code.co_name == function and name in frame.f_locals:
            return frame.f_locals[name]
        frame = frame.f_back
    return None


def _missing(what: str) -> None:
    print(f"ckptrun: warm worker: {what} not found (torch or multiprocessing changed): {RETURN_QUEUE} {SENTINEL}",
          file=sys.stderr, flush=True)


def hide_sentinel_from_forks() -> None:
    """Every process this rank forks closes the rank's sentinel, so that the agent sees the rank's own exit."""
    sentinel, rank_pid = caller_local(*SENTINEL), os.getpid()
    if not isinstance(sentinel, int):
        return _missing("the rank's sentinel")

    def close() -> None:
        if os.getppid() != rank_pid:  # a grandchild: its parent closed it already, the number may be another file's
            return
        with contextlib.suppress(OSError):  # already closed
            os.close(sentinel)

    os.register_at_fork(after_in_child=close)


def post_success_on_quiet_exit() -> Callable[[], None]:
    """Make ``os._exit(0)`` post the rank's return value first; returns the undo (for when the script has returned)."""
    queue, real_exit, rank_pid = caller_local(*RETURN_QUEUE), os._exit, os.getpid()
    if queue is None:
        _missing("the rank's return queue")
        return lambda: None

    def exit_posting(code: int) -> None:
        if code == 0 and os.getpid() == rank_pid:  # not a process the rank forked (a data-loader worker)
            with contextlib.suppress(Exception):  # leaving must not fail
                queue.put(None)
        real_exit(code)

    os._exit = exit_posting  # type: ignore[assignment]

    def undo() -> None:
        os._exit = real_exit  # type: ignore[assignment]

    return undo


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.exit("usage: warm_start.py PID_DIR (SCRIPT | -m MODULE) [ARGS...]")
    timeline.mark("process")  # this rank's start: its fork, give or take torch's setup (more exact than psutil's)
    if fork_safety.cuda_poisoned():  # before anything else: the agent spawns the ranks instead
        fork_safety.leave_for_spawn(Path(argv[0]))
    note_pid(Path(argv[0]))
    fork_safety.close_inherited_listeners()
    reset_signals()
    atexit._clear()
    apply_threads()
    bind_local_device()
    reseed_numpy()
    hide_sentinel_from_forks()
    undo = post_success_on_quiet_exit()
    from ckptrun.runtime.worker import bootstrap

    try:
        bootstrap.main(argv[1:])
    except SystemExit as exc:
        if exc.code is not None and exc.code != 0:
            raise
        # `sys.exit(main())` with main() returning None: a normal end, as for a cold interpreter. torch's
        # record() treats only SystemExit(0) as a return, so leaving with SystemExit(None) would never post the
        # rank's return value and the agent would wait for it forever: return instead (the caller posts it).
    except BaseException as exc:  # recorded by the bootstrap: leave as a cold interpreter would, keeping its error file
        print_user_exception(exc)
        raise SystemExit(1) from None
    finally:
        undo()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
