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
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import psutil

from ckptrun.cli.supervision.attempt import kill_all, wait_gone
from ckptrun.cli.supervision.failures import RankFailure, from_error_file, write_failures
from ckptrun.runtime.env import EnvError, RunEnv
from ckptrun.runtime.liveness import watch_supervisor

RANKS_EXIT_S = 3.0


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
    _watch_supervisor()
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(torchrun_args))
    except ChildFailedError as exc:
        write_failures(record, [_facts(rank, failure) for rank, failure in sorted(exc.failures.items())])
        print(exc.format_msg(), file=sys.stderr, flush=True)
        return 1
    except Exception as exc:  # noqa: BLE001 - torchrun itself failed (rendezvous, bad args): record it
        write_failures(record, [], agent_error=f"{type(exc).__name__}: {exc}")
        print(f"torchrun failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


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
