"""The worker entry point ``ckptrun launch`` gives torchrun: run the user's script, record why it died.

torchrun learns a worker's failure from the JSON file named by
``TORCHELASTIC_ERROR_FILE`` (what ``@record`` writes). A user's script is not
decorated, and a ``SyntaxError`` happens before any decorator could run, so this
shim compiles and runs the script itself and writes that file for every
uncaught exception, in torchrun's format plus ``ckptrun_phase``: ``load`` when
the script never started (missing file, syntax error: a restart cannot help),
``run`` otherwise, and whether the script had imported ``ckptrun.runtime`` (so
the supervisor knows a failure before the first heartbeat is not a plain
script's). It also installs the SIGUSR2 stack dump early, so a rank that
hangs before ``ckptrun.runtime.init()`` still shows where it is.

Usage (what torchrun runs): ``python -m ckptrun.runtime.bootstrap SCRIPT [ARGS...]``
or ``python -m ckptrun.runtime.bootstrap -m MODULE [ARGS...]``. Importable
without torch.
"""

from __future__ import annotations

import faulthandler
import importlib.util
import json
import os
import runpy
import signal
import sys
import time
import traceback
from types import CodeType

ERROR_FILE_VARIABLE = "TORCHELASTIC_ERROR_FILE"  # torchrun's name, not a ckptrun contract
_recorded: set[int] = set()


def _uses_runtime() -> bool:
    """Whether the script got as far as loading the runtime (any module besides this shim)."""
    return any(name.startswith("ckptrun.runtime.") and name != __name__ and name != "ckptrun.runtime.bootstrap"
               for name in sys.modules)


def record_failure(exc: BaseException, phase: str) -> None:
    """Write torchrun's error-file JSON for ``exc`` (no-op outside torchrun)."""
    path = os.environ.get(ERROR_FILE_VARIABLE)
    _recorded.add(id(exc))
    if not path:
        return
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(exc)),
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
    try:
        _compile_script(path)  # fail here, as phase "load", before the script runs anything
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
    sys.argv = [spec.origin or name, *args]
    runpy.run_module(name, run_name="__main__", alter_sys=True)


def main(argv: list[str]) -> None:
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        sys.exit("usage: python -m ckptrun.runtime.bootstrap (SCRIPT | -m MODULE) [ARGS...]")
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR2, file=sys.stderr, all_threads=True, chain=False)
    try:
        if argv[0] == "-m":
            _run_module(argv[1], argv[2:])
        else:
            _run_script(argv[0], argv[1:])
    except SystemExit:
        raise
    except BaseException as exc:
        if id(exc) not in _recorded:
            record_failure(exc, "run")
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
