"""One rank of the per-step runtime work figure: what ckptrun adds to every step of a 2-rank run, part by part.

Started twice by ``runtime_overhead.py`` (ranks 0 and 1, gloo on localhost).
Each rank builds a real ``Run`` (``ckr.init``) with a tracked
``ckr.DataLoader`` and runs the loop a template runs — ``for batch in
run.batches(loader, steps): <step>; run.end_step(loss)`` — where the step is
``--step-ms`` of busy compute with a small all-reduce inside, as DDP's
(the template's median step, so the shared facts' collective has as long to
arrive as it has there, the ranks stay in step as DDP keeps them, and
``decision_every_steps=auto`` picks the N it would there). Everything between
the end of one step's compute and the start of the next is the runtime's
(``end_step``, the boundary and heartbeat of ``run.batches``, the loader's
cursor), except the data loader's own fetch, which is timed and left out.

The work is counted in CPU seconds of the training thread (``thread_time``),
so a rank preempted by another process on a shared machine does not inflate
it, plus the CPU the shared facts' collective costs gloo's threads in the
background (measured apart: exchanges of N steps' facts with the training
thread asleep in between, process CPU minus thread CPU, less the same with
no exchange — gloo's idle polling, which a job without ckptrun pays too —
divided by N). Wall-clock medians are reported
beside. Passes alternate: a plain one gives the total per step; a timed one
wraps each part (the shared-facts exchange, the metrics line, the heartbeat,
the stop check, the save bookkeeping, the anomaly check, the data position)
in a CPU timer for its share. Means per step, so a heartbeat written once a
second counts for its share. Rank 0 prints one JSON line.

    python bench/step_work.py --rank R --world 2 --port P --steps 300 --step-ms 12 --run-dir DIR
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import init_world

# ----------------------------------------------------------------------------- config
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--rank", type=int, required=True)
parser.add_argument("--world", type=int, default=2)
parser.add_argument("--port", type=int, required=True)
parser.add_argument("--steps", type=int, default=300, help="steps per pass")
parser.add_argument("--repeats", type=int, default=5, help="plain + timed passes")
parser.add_argument("--step-ms", type=float, default=12.0, help="the stand-in step's compute")
parser.add_argument("--run-dir", type=Path, required=True)
parser.add_argument("--decision-every", default="auto", help="the run's decision_every_steps (auto, or N: 1 is every step)")
args = parser.parse_args()

from ckptrun.runtime.env import RunEnv

os.environ.update(RunEnv(run_id="bench-step-work", run_dir=args.run_dir, precision="fp32", threads=1,
                         decision_every_steps=args.decision_every).to_env())
init_world(args.rank, args.world, args.port)

import torch
from torch.utils.data import TensorDataset

import ckptrun.runtime as ckr

run = ckr.init()
data = TensorDataset(torch.randn(4096, 64), torch.randint(0, 10, (4096,)))
loader = ckr.DataLoader(data, batch_size=32, shuffle=True, num_workers=0, seed=0)
run.track(loader=loader)
fetch_s = [0.0, 0.0]  # wall and CPU seconds in torch's own DataLoader fetch since the last reset: not runtime work


class TimedFetch:
    """torch's own DataLoader iterator (what ckr.DataLoader's cursor draws from), its ``next()`` timed."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __next__(self) -> Any:
        started, started_cpu = time.perf_counter(), time.thread_time()
        try:
            return next(self.inner)
        finally:
            fetch_s[0] += time.perf_counter() - started
            fetch_s[1] += time.thread_time() - started_cpu

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


untimed_iterator = loader._get_iterator  # torch.utils.data.DataLoader's (num_workers=0: a new one per epoch)
loader._get_iterator = lambda: TimedFetch(untimed_iterator())  # type: ignore[method-assign]


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


GRADIENTS = torch.zeros(1024)


def step(seconds: float) -> None:
    """The stand-in step: forward and backward, DDP's gradient all-reduce (it keeps the ranks in step, and
    their skew waits there, not in the runtime's exchange), then the optimizer."""
    spin(0.7 * seconds)
    torch.distributed.all_reduce(GRADIENTS)
    spin(0.3 * seconds)


def one_pass(steps: int) -> tuple[float, float]:
    """Mean runtime CPU seconds per step and the median wall seconds over ``steps`` steps."""
    cpu_s, walls, after_end = 0.0, [], None
    for _ in run.batches(loader, steps=run.step + steps):
        top, top_cpu = time.perf_counter(), time.thread_time()
        if after_end is not None:  # the boundary: from the end of end_step to here, less the data fetch
            cpu_s += top_cpu - after_end[1] - fetch_s[1]
            walls.append(top - after_end[0] - fetch_s[0] + walls.pop())
        step(args.step_ms / 1000)
        computed, computed_cpu = time.perf_counter(), time.thread_time()
        run.end_step(2.302585092994046 + 1e-3 * args.rank)
        after_end = (time.perf_counter(), time.thread_time())
        fetch_s[:] = [0.0, 0.0]
        cpu_s += after_end[1] - computed_cpu
        walls.append(after_end[0] - computed)
    return cpu_s / len(walls), statistics.median(walls)


def background_cpu(exchanges: int) -> float:
    """CPU seconds gloo's threads spend per step on the shared facts: process CPU minus this thread's per exchange
    of a batch of the run's N steps, the thread asleep between, divided by N (one exchange per N steps)."""
    every = run.exchange.every
    idle = _idle_cpu(exchanges)
    process, thread = time.process_time(), time.thread_time()
    for index in range(exchanges):
        for step in range(every):
            run.exchange.add(10**9 + index * every + step, 1.0)
        run.exchange.start(False, False, False)
        time.sleep(args.step_ms / 1000)
        run.exchange.take()
    per_exchange = ((time.process_time() - process) - (time.thread_time() - thread)) / exchanges
    return max(0.0, per_exchange - idle) / every


def _idle_cpu(sleeps: int) -> float:
    """Other threads' CPU per sleep of a step with no exchange (gloo's idle polling), left out of the exchange's."""
    process, thread = time.process_time(), time.thread_time()
    for _ in range(sleeps):
        time.sleep(args.step_ms / 1000)
    return ((time.process_time() - process) - (time.thread_time() - thread)) / sleeps


# ----------------------------------------------------------------------------- the parts
spent: dict[str, float] = defaultdict(float)


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*a: Any, **k: Any) -> Any:
        started = time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            spent[name] += time.thread_time() - started

    return wrapper


PARTS = {  # part: the leaf calls it is made of (none calls another)
    "shared_facts": [(run.exchange, "add"), (run.exchange, "start"), (run.exchange, "take")],
    "metrics_record": [(run, "_step_record")],
    "metrics_write": [(run.metrics_log, "append_many")],
    "heartbeat": [(run.heart, "beat")],
    "stop_check": [(run, "_stop_requested")],
    "save_bookkeeping": [(run, "_settle_saves"), (run, "_time_to_save")],
    "anomaly_check": [(run.anomalies, "check")],
    "data_position": [(loader, "commit")],
}


def wrap() -> None:
    for part, calls in PARTS.items():
        for owner, name in calls:
            setattr(owner, name, timed(part, getattr(owner, name)))


def unwrap() -> None:
    for calls in PARTS.values():
        for owner, name in calls:
            owner.__dict__.pop(name, None)


# ----------------------------------------------------------------------------- measure
one_pass(30)  # warm-up: first heartbeat, first line, the allocator
totals, walls, timed_totals, parts, background = [], [], [], defaultdict(list), []
for _ in range(args.repeats):
    cpu, wall = one_pass(args.steps)
    wrap()
    spent.clear()
    timed_cpu, _ = one_pass(args.steps)
    unwrap()
    background.append(background_cpu(max(20, args.steps // 5)))
    totals.append(cpu + background[-1])
    timed_totals.append(timed_cpu + background[-1])
    walls.append(wall)
    for part in PARTS:
        parts[part].append(spent[part] / args.steps + (background[-1] if part == "shared_facts" else 0.0))
if args.rank == 0:
    print(json.dumps({"runtime_per_step_s": totals, "runtime_wall_median_s": walls, "timed_per_step_s": timed_totals,
                      "exchange_background_cpu_s": background, "parts_s": parts, "decision_every_steps": run.exchange.every}),
          flush=True)
run.finish()
