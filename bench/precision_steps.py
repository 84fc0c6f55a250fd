"""Step time of the default template per precision mode (2 CPU ranks, plain torchrun), interleaved.

Usage: python bench/precision_steps.py [--repeats 3] [--steps 60]. Prints the
median step time of each mode (steps 10..end of each run, from metrics.jsonl)
and the ratio against fp32 measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ckptrun.runtime.records import read_metrics

MODES = ("fp32", "bf16", "fp16")


def one_run(mode: str, steps: int) -> float:
    run_dir = Path(tempfile.mkdtemp()) / mode
    env = {**os.environ, "CKPTRUN_RUN_DIR": str(run_dir), "CKPTRUN_PRECISION": mode, "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "-m", "ckptrun.templates.default_job", "--steps", str(steps)]
    subprocess.run(command, env=env, check=True, capture_output=True)
    times = [m["step_time_s"] for m in read_metrics(run_dir) if m["step"] > 10]
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    samples: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.repeats):
        for mode in MODES:  # interleaved A/B/C
            samples[mode].append(one_run(mode, args.steps))
    base = statistics.median(samples["fp32"])
    for mode in MODES:
        median = statistics.median(samples[mode])
        print(f"{mode:5s} median step {median * 1000:7.2f} ms  (min {min(samples[mode]) * 1000:.2f}, "
              f"max {max(samples[mode]) * 1000:.2f})  x{median / base:.2f} of fp32")


if __name__ == "__main__":
    main()
