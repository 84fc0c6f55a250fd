"""Start-up cost of the CLI: ``ckptrun --help`` against a bare ``python -c pass``, interleaved.

Also checks, once, that printing the help imports no torch (the import
hygiene rule): ``help_imports_torch`` is 1.0 when it does.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from common import NA, Figure, interleave

CHECK = """
import sys
sys.argv = ["ckptrun", "--help"]
from ckptrun.cli.main import main
try:
    main()
except SystemExit:
    pass
sys.stderr.write("TORCH=%d" % ("torch" in sys.modules))
"""


def wall(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True)
    return time.perf_counter() - started


def help_imports_torch() -> bool:
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, check=True)
    return "TORCH=1" in result.stderr


def measure(repeats: int) -> dict[str, Figure]:
    ckptrun = str(Path(sys.executable).with_name("ckptrun"))
    wall([ckptrun, "--help"])  # the first run pays for cold .pyc and page-cache misses; every later one does not
    samples = interleave(repeats, {"help": lambda: {"help_s": wall([ckptrun, "--help"])},
                                   "python": lambda: {"python_startup_s": wall([sys.executable, "-c", "pass"])}})
    return {
        "help_s": Figure(samples["help_s"], "s", "page-cached", note="`ckptrun --help` wall time"),
        "python_startup_s": Figure(samples["python_startup_s"], "s", "page-cached", note="`python -c pass` (the venv's)"),
        "help_imports_torch": Figure([float(help_imports_torch())], "bool", NA, note="1 = `ckptrun --help` imported torch"),
    }
