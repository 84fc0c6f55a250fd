"""Start-up cost of the CLI: ``ckptrun --help`` against a bare ``python -c pass``, interleaved; and (``--first-step``)
a launch's first step with ranks forked from the agent (warm workers) against new interpreters.

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


# --- a launch's first step: ranks forked from the agent (warm workers) vs new interpreters -------------

FIRST_STEP_FLAGS = ["--nproc-per-node", "2", "--threads", "1", "--save-every-steps", "1000", "--ranks-output", "none"]


def launch_to_first_step(scratch: Path, extra: list[str]) -> float:
    """``ckptrun launch`` of the default job (2 ranks): seconds from the ``launch`` event to rank 0's first step."""
    import json
    import uuid

    run_dir = scratch / uuid.uuid4().hex[:8]
    command = [sys.executable, "-m", "ckptrun.cli.main", "launch", *FIRST_STEP_FLAGS, *extra, "--run-dir", str(run_dir),
               "--name", run_dir.name, "--", "--steps", "3"]
    subprocess.run(command, check=True, capture_output=True, cwd=scratch)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    launched = next(e["time"] for e in events if e["event"] == "launch")
    return min(m["time"] for m in metrics if "step" in m) - launched


def first_step(repeats: int) -> dict[str, Figure]:
    """The first attempt forks its ranks too: launch → first step with and without ``--warm-workers``, interleaved."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ckptrun-first-step-") as scratch:
        samples = interleave(repeats, {
            "warm": lambda: {"first_step_warm_s": launch_to_first_step(Path(scratch), [])},
            "spawn": lambda: {"first_step_spawn_s": launch_to_first_step(Path(scratch), ["--no-warm-workers"])}})
    note = f"launch -> first step, default job on 2 CPU ranks; load average {os.getloadavg()[0]:.2f} at the end"
    return {"first_step_warm_s": Figure(samples["first_step_warm_s"], "s", "page-cached", 2, note + " (warm workers)"),
            "first_step_spawn_s": Figure(samples["first_step_spawn_s"], "s", "page-cached", 2, note + " (--no-warm-workers)")}


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="start-up figures; --first-step: launch -> first step, warm vs spawned ranks")
    parser.add_argument("--first-step", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    found = first_step(args.repeats) if args.first_step else measure(args.repeats)
    for key, figure in found.items():
        print(f"{key:24} median {figure.median:.3f} {figure.unit}  samples {[round(s, 3) for s in figure.samples]}  {figure.note}")
