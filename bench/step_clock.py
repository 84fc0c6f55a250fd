"""Run a training script with a clock on every optimizer step: the same stopwatch for both arms of an A/B.

The template's own metrics time its steps one way and ``plain_job.py``
another; comparing them compares two stopwatches as well as two jobs. This
wrapper registers torch's global optimizer-step post-hook before the script
runs, so both arms are timed at the same point of every step (right after
``optimizer.step()``), by the same code, and records per step the wall
seconds and the process CPU seconds (every thread of the rank, gloo's
included; not its data-loader workers). CPU seconds barely move when other
processes share the cores, which wall seconds do a lot on a loaded 2-core
machine. Each rank writes ``OUT.rank<R>.json`` at exit.

    python bench/step_clock.py --out DIR/steps (SCRIPT | -m MODULE) [ARGS...]
    torchrun --nproc-per-node 2 bench/step_clock.py --out DIR/steps -m ckptrun.templates.default_job --steps 200
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
import time


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[0] != "--out":
        sys.exit("usage: step_clock.py --out PREFIX (SCRIPT | -m MODULE) [ARGS...]")
    out, rest = argv[1], argv[2:]
    import torch.optim.optimizer as optimizer

    walls: list[float] = []
    cpus: list[float] = []
    last = [time.perf_counter(), time.process_time()]

    def tick(*_: object) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        walls.append(wall - last[0])
        cpus.append(cpu - last[1])
        last[:] = [wall, cpu]

    optimizer.register_optimizer_step_post_hook(tick)
    pid = os.getpid()

    def write() -> None:
        if os.getpid() == pid:  # not a forked data-loader worker
            with open(f"{out}.rank{os.environ.get('RANK', '0')}.json", "w") as stream:
                json.dump({"wall_s": walls, "cpu_s": cpus}, stream)

    atexit.register(write)
    if rest[0] == "-m":
        sys.argv = [rest[1], *rest[2:]]
        runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = rest
        runpy.run_path(rest[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
