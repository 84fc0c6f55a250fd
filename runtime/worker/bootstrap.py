"""The worker entry point ``ckptrun launch`` gives torchrun: run the user's script, record why it died.

torchrun learns a worker's failure from the JSON file named by
``TORCHELASTIC_ERROR_FILE`` (what ``@record`` writes). A user's script is not
decorated, and a ``SyntaxError`` happens before any decorator could run, so this
shim compiles and runs the script itself and writes that file for every
uncaught exception, in torchrun's format plus ``ckptrun_phase``: ``load`` when
the script never started (missing file, syntax error: a restart cannot help),
``run`` otherwise, and whether the script had imported ``ckptrun.runtime`` (so
the supervisor knows a failure before the first heartbeat is not a plain
script's; a script whose code imports it counts even when it failed before
``init()``). A ``sys.exit`` with a non-zero code is recorded too. Before the
script runs it installs, for every script: the SIGUSR2 stack dump (a rank that
hangs before ``init()``, or never calls it, still shows where it is), the
watch on the supervisor (a SIGKILLed supervisor leaves no rank behind) and
the optimizer-step hook (:mod:`ckptrun.runtime.worker.step_hook`: a plain script's
steps beat the heartbeat).

Usage (what torchrun runs): ``python -m ckptrun.runtime.worker.bootstrap SCRIPT [ARGS...]``
or ``python -m ckptrun.runtime.worker.bootstrap -m MODULE [ARGS...]``. Importable
without torch.
"""

from __future__ import annotations

import faulthandler
import importlib.util
import json
import os
import runpy
import sys
import time
from types import CodeType

from ckptrun.runtime.worker import determinism, step_hook, timeline
from ckptrun.runtime.env import EnvError, RunEnv
from ckptrun.runtime.worker.liveness import enable_stack_dumps, watch_supervisor
from ckptrun.runtime.worker.user_traceback import format_user_exception, print_user_exception

ERROR_FILE_VARIABLE = "TORCHELASTIC_ERROR_FILE"  # torchrun's name, not a ckptrun contract
_recorded: set[int] = set()
_OWN_MODULES = frozenset(name for name in sys.modules if name.startswith("ckptrun.runtime."))
_imports_runtime = False  # the script's code imports ckptrun.runtime (set when it is compiled)


def _uses_runtime() -> bool:
    """Whether the script uses the runtime: its code imports it, it called ``init()``, or it loaded a runtime
    module this shim does not (a warm worker's agent may have loaded them all before: the first two tell)."""
    return _imports_runtime or "init" in timeline.MARKS or any(
        name.startswith("ckptrun.runtime.") and name not in _OWN_MODULES and name != "ckptrun.runtime.worker.bootstrap"
        for name in sys.modules)


def names_runtime(code: CodeType) -> bool:
    """Whether compiled code imports ckptrun.runtime anywhere (nested functions included)."""
    names = set(code.co_names)
    if any(name.startswith("ckptrun.runtime") for name in names) or {"ckptrun", "runtime"} <= names:
        return True
    return any(names_runtime(const) for const in code.co_consts if isinstance(const, CodeType))


def _message(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return exc.code if isinstance(exc.code, str) else f"exited with code {exc.code}"
    return f"{type(exc).__name__}: {exc}"


def record_failure(exc: BaseException, phase: str) -> None:
    """Write torchrun's error-file JSON for ``exc`` (no-op outside torchrun)."""
    path = os.environ.get(ERROR_FILE_VARIABLE)
    _recorded.add(id(exc))
    if not path:
        return
    data = {
        "message": {
            "message": _message(exc),
            "extraInfo": {
                "py_callstack": format_user_exception(exc),
                "timestamp": str(int(time.time())),
                "time": time.time(),
                "ckptrun_phase": phase,
                "ckptrun_runtime": _uses_runtime(),
            },
        }
    }
    try:
        with open(path, "w") as stream:
            json.dump(data, stream)
    except OSError as error:
        print(f"ckptrun: could not write the error file {path}: {error}", file=sys.stderr)


def _compile_script(path: str) -> CodeType:
    with open(path, "rb") as stream:
        source = stream.read()
    return compile(source, path, "exec")


def _run_script(path: str, args: list[str]) -> None:
    global _imports_runtime
    try:
        _imports_runtime = names_runtime(_compile_script(path))  # fail here, as phase "load", before it runs
    except (OSError, SyntaxError, ValueError) as exc:
        record_failure(exc, "load")
        raise
    sys.argv = [path, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(path))
    runpy.run_path(path, run_name="__main__")


def _run_module(name: str, args: list[str]) -> None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError) as exc:
        record_failure(exc, "load")
        raise
    if spec is None:
        exc = ModuleNotFoundError(f"No module named {name!r}")
        record_failure(exc, "load")
        raise exc
    global _imports_runtime
    try:
        code = spec.loader.get_code(name) if spec.loader is not None and hasattr(spec.loader, "get_code") else None
    except (ImportError, SyntaxError) as exc:
        record_failure(exc, "load")
        raise
    _imports_runtime = code is not None and names_runtime(code)
    sys.argv = [spec.origin or name, *args]
    runpy.run_module(name, run_name="__main__", alter_sys=True)


def main(argv: list[str]) -> None:
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        sys.exit("usage: python -m ckptrun.runtime.worker.bootstrap (SCRIPT | -m MODULE) [ARGS...]")
    timeline.mark("bootstrap")
    if "torch" in sys.modules:  # a warm worker (warm_start.py): forked from an agent that imported it
        timeline.mark("torch_imported")
    sys.meta_path.insert(0, step_hook.AfterImport("torch", lambda _: timeline.mark("torch_imported")))
    faulthandler.enable(all_threads=True)
    enable_stack_dumps()
    _watch_supervisor()
    step_hook.install()
    try:
        if argv[0] == "-m":
            _run_module(argv[1], argv[2:])
        else:
            _run_script(argv[0], argv[1:])
        step_hook.script_returned()
    except SystemExit as exc:
        if exc.code not in (None, 0):
            record_failure(exc, "run")
        else:
            step_hook.script_returned()
        raise
    except KeyboardInterrupt as exc:
        if id(exc) not in _recorded:
            record_failure(exc, "run")
        raise
    except BaseException as exc:  # printed from the user's first frame (user_traceback), exit 1 as Python's own
        if id(exc) not in _recorded:
            record_failure(exc, "run")
        determinism.refuse_if_nondeterministic(exc)  # torch's "no deterministic implementation": one line, exit 4
        print_user_exception(exc)
        raise SystemExit(1) from None


def _watch_supervisor() -> None:
    """Every rank exits when the supervisor is gone, whether or not the script ever calls ``init()``."""
    try:
        env = RunEnv.from_env()
    except EnvError:
        return  # init() reports a malformed C1; a plain script under ckptrun never sees one
    watch_supervisor(env.supervisor_pid, env.supervisor_start_time)


if __name__ == "__main__":
    main(sys.argv[1:])
