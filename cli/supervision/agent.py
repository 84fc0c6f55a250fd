"""torchrun, plus a record of how each rank failed: the process ``ckptrun launch`` starts per attempt.

Usage: ``python -m ckptrun.cli.supervision.agent FAILURES_JSON [TORCHRUN ARGS...]``. It runs
``torch.distributed.run`` unchanged and, when torchrun gives up with
``ChildFailedError``, writes ``ChildFailedError.failures`` (exit code or signal,
error-file contents, per rank) to FAILURES_JSON through :mod:`ckptrun.cli.supervision.failures`.
The supervisor reads that file instead of scraping torchrun's log. Like every
rank, it watches the supervisor: when that is gone (a SIGKILL) it gives its
ranks a few seconds to leave on their own, kills those left (they run in
sessions of their own) and exits, so nothing of the run is
left behind. It exits with ``os._exit`` once torchrun returns: a restart
waits for this process, and finalising torch is slow. This is a separate
process (it imports torch); the CLI never imports it.

With warm workers (``--start-method fork --run-path runtime/worker/warm_start.py``, see that module) the ranks
are forked from this process: what it has loaded is frozen out of the garbage collector first (fewer
copied pages in each rank), and torch's log line about a failed forked rank is kept without the agent's
traceback (formatting it imports ``torch._dynamo``: seconds, on the restart's critical path). The agent runs with
``PYTORCH_NVML_BASED_CUDA_CHECK=1`` and touches no ``torch.cuda`` itself, so that its ranks can use CUDA after
the fork; should they not, it runs the attempt again with spawned ranks (:mod:`fork_fallback`).
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from pathlib import Path

import psutil

from ckptrun.cli.supervision import fork_fallback
from ckptrun.cli.supervision.attempt import kill_all, wait_gone
from ckptrun.cli.supervision.failures import RankFailure, from_error_file, write_failures
from ckptrun.cli.supervision.warm_ranks import RankEnds
from ckptrun.runtime.env import EnvError, RunEnv
from ckptrun.runtime.worker.liveness import watch_supervisor

RANKS_EXIT_S = 3.0
WARM_IMPORTS = "ckptrun.runtime.worker.bootstrap"  # loaded last by warm_imports: a standby's agent has it
FORKED_RANKS_LOGGER = "torch.distributed.elastic.multiprocessing.api"  # logs a forked rank's failure with its traceback


def _facts(global_rank: int, failure: object) -> RankFailure:
    data = getattr(failure, "error_file_data", None)
    facts = from_error_file(global_rank, int(getattr(failure, "exitcode")), getattr(failure, "error_file", None),
                            data if isinstance(data, dict) else None)
    if facts.time is None:
        facts.time = float(getattr(failure, "timestamp", 0) or 0) or None
    return facts


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m ckptrun.cli.supervision.agent FAILURES_JSON [TORCHRUN ARGS...]", file=sys.stderr)
        return 2
    record, torchrun_args = Path(argv[0]), argv[1:]
    os.environ.update(fork_fallback.CUDA_FORK_SAFE)  # before torchrun reads its config (LaunchConfig.__post_init__)
    _watch_supervisor()
    logging.getLogger(FORKED_RANKS_LOGGER).addFilter(_without_traceback)
    ends = _forked_rank_ends(torchrun_args)
    if ends is not None and WARM_IMPORTS not in sys.modules:  # a fresh agent (the first attempt) forking its ranks
        warm_imports()  # a standby did it already: the first attempt's ranks get what a restart's get
    gc.freeze()  # what is loaded now is never collected: ranks forked from here (warm workers) copy fewer pages
    code = _torchrun(record, torchrun_args, ends)
    refused = fork_fallback.bad_fork_ranks(ends.pid_dir) if ends is not None and code != 0 else []
    if refused:  # the forked ranks could not use CUDA: this attempt again, with spawned ranks
        fork_fallback.announce(refused)
        record.unlink(missing_ok=True)  # the forked round's failures are not this attempt's
        code = _torchrun(record, fork_fallback.spawn_args(torchrun_args), None)
    return code


def warm_imports() -> None:
    """What a warm rank would import first, loaded in the agent that forks it: by a warm standby before its word,
    and by a fresh agent (the first attempt's) before it forks, so the first attempt's set-up and first step are
    what a restart repeats (``estimate-rto`` reads them): the bootstrap, and the runtime a ckptrun script loads at
    ``init()`` (a plain script's ranks inherit it unused). No thread is started by these imports (fork safety). The
    bootstrap last: what is loaded before it does not count as the script's use of the runtime.
    ``torch._inductor.config`` is what ``torch.use_deterministic_algorithms`` imports (torch._dynamo, sympy):
    the largest part of ``init()`` in a rank that did not have it."""
    import torch._inductor.config  # noqa: F401

    import ckptrun.runtime.step.data  # noqa: F401
    import ckptrun.runtime.step.startup  # noqa: F401
    import ckptrun.runtime.worker.bootstrap  # noqa: F401


def _torchrun(record: Path, torchrun_args: list[str], ends: RankEnds | None) -> int:
    """Run torchrun once; on failure write the failures record (``ends``: forked ranks' ends, see warm_ranks)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(torchrun_args))
    except ChildFailedError as exc:
        failures = [_facts(rank, failure) for rank, failure in sorted(exc.failures.items())]
        write_failures(record, ends.complete(failures) if ends is not None else failures)
        print(exc.format_msg(), file=sys.stderr, flush=True)
        return 1
    except Exception as exc:  # noqa: BLE001 - torchrun itself failed (rendezvous, bad args): record it
        write_failures(record, [], agent_error=f"{type(exc).__name__}: {exc}")
        print(f"torchrun failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


def _forked_rank_ends(torchrun_args: list[str]) -> RankEnds | None:
    """With warm workers (``--run-path WARM_START PID_DIR …``): a watch on every forked rank's end."""
    if "--run-path" not in torchrun_args:
        return None
    ends = RankEnds(Path(torchrun_args[torchrun_args.index("--run-path") + 2]))
    ends.start()
    return ends


def _without_traceback(record: logging.LogRecord) -> bool:
    """Drop the agent's own traceback from torch's "failed (exitcode …)" line about a forked rank (warm workers):
    torch's log formatter imports ``torch._dynamo`` to print one (seconds, on a restart's critical path), and the
    rank's failure is recorded anyway (its error file, the failures record)."""
    record.exc_info, record.exc_text = None, None
    return True


def _watch_supervisor() -> None:
    try:
        env = RunEnv.from_env()
    except EnvError:
        return  # the ranks' init() reports a malformed C1
    watch_supervisor(env.supervisor_pid, env.supervisor_start_time, on_gone=_end_ranks)


def _end_ranks() -> None:
    """The ranks' own watches exit them within a second or two; SIGKILL any still there (stuck in C code)."""
    kill_all(wait_gone(psutil.Process().children(recursive=True), RANKS_EXIT_S))


def leave(code: int) -> None:
    """Exit without finalising the interpreter: torchrun has stopped its workers and its store by now, and
    unloading torch took most of a crashed attempt's teardown (a restart waits for this process to end)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    leave(main(sys.argv[1:]))
