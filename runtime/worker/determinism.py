"""An op without a deterministic kernel, under ``--deterministic`` (the default): one line, two ways out, exit 4.

``init()`` calls ``torch.use_deterministic_algorithms(True)``; on CUDA some ops (``index_add_``,
``scatter_add_``, ``histc``, interpolation backwards, …) then raise at the first step with torch's
"``<op>`` does not have a deterministic implementation, but you set
'torch.use_deterministic_algorithms(True)'" — a traceback deep in the user's model, and an error a
restart cannot fix. The bootstrap hands every uncaught exception to :func:`refuse_if_nondeterministic`,
which names the op and both fixes (``--no-deterministic``, or the op's deterministic alternative), writes
a fatal record so that the supervisor does not retry, and exits 4. Importable without torch.
"""

from __future__ import annotations

import os
import re
import sys

from ckptrun.runtime import records
from ckptrun.runtime.env import EnvError, RunEnv

EXIT_UNRECOVERABLE = 4
_TORCH_MESSAGE = re.compile(r"(?P<op>\S[^\n]*?) does not have a deterministic implementation, but you set "
                            r"'torch\.use_deterministic_algorithms\(True\)'")


def nondeterministic_op(exc: BaseException) -> str | None:
    """The op torch's determinism check names in ``exc``, or None when ``exc`` is something else."""
    if not isinstance(exc, RuntimeError):
        return None
    found = _TORCH_MESSAGE.search(str(exc))
    return found.group("op").strip() if found else None


def message(op: str) -> tuple[str, str]:
    """The error line and the hint line."""
    return (f"{op} has no deterministic implementation, and this run is deterministic (--deterministic, the default)",
            f"launch with --no-deterministic (resumes are then not bitwise exact), or replace {op} with a "
            "deterministic alternative (e.g. a sort- or gather-based form, a CPU op, a different interpolation mode)")


def refuse_if_nondeterministic(exc: BaseException) -> None:
    """Exit 4 with one line and a fatal record when ``exc`` is torch's determinism error; else return."""
    op = nondeterministic_op(exc)
    if op is None:
        return
    error, hint = message(op)
    try:
        env = RunEnv.from_env()
    except EnvError:
        env = None
    if env is not None and "run_dir" in env.model_fields_set:  # any rank: the one that hit it may not be rank 0
        records.write_fatal(env.run_dir, int(os.environ.get("RANK", "0")), f"{error}; {hint}", EXIT_UNRECOVERABLE)
    print(f"error: {error}\nhint: {hint}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_UNRECOVERABLE) from None
