"""What the runtime adds to every training step of the default template.

Two views, measured in the same run:

* **per call** — the step-boundary work of ``Run`` measured call by call:
  heartbeat checks (two per step; a heartbeat file is written at most once per
  interval, so its write cost counts step/interval times), the metrics line (one
  ``O_APPEND`` write), the stop-file check and the shared-decisions all-reduce
  of four floats (measured between two gloo ranks, the smallest world where it
  is not a no-op). ``runtime_overhead`` = their sum per step ÷ the template's
  median step time.
* **A/B** — the template (``python -m ckptrun.templates.default_job``, world
  size 1) against ``plain_job.py``, the same job written without ckptrun,
  interleaved; ``template_ab_ratio`` = median step with ÷ median step without,
  per repeat. Steps 1..10 (warm-up, first-step precision report) are left out.
  Both sides run torch with one thread: on a shared 2-core machine two OpenMP
  threads stall at every barrier another process preempts, which buries a 2%
  difference in noise (steps of 10-900 ms instead of ~12 ms).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import NA, Figure, interleave, median_of, ratio_samples

HERE = Path(__file__).resolve().parent
WARMUP = 10
CALLS = 400
THREADS = 1


def _job_env(run_dir: Path) -> dict[str, str]:
    from ckptrun.runtime.env import RunEnv

    # fp32 like plain_job.py: `auto` would pick bf16 on AMX CPUs and compare two different jobs
    env = RunEnv(run_id="bench", run_dir=run_dir, threads=THREADS, precision="fp32").to_env()
    return {**os.environ, **env, "PYTHONWARNINGS": "ignore"}


def template_step(scratch: Path, steps: int, index: list[int]) -> float:
    from ckptrun.runtime.records import read_metrics

    index[0] += 1
    run_dir = scratch / f"template-{index[0]}"
    command = [sys.executable, "-m", "ckptrun.templates.default_job", "--steps", str(steps)]
    subprocess.run(command, env=_job_env(run_dir), check=True, capture_output=True, cwd=scratch)
    times = [m["step_time_s"] for m in read_metrics(run_dir) if m.get("step", 0) > WARMUP]
    return statistics.median(times)


def plain_step(scratch: Path, steps: int) -> float:
    out = scratch / "plain-steps.json"
    command = [sys.executable, str(HERE / "plain_job.py"), "--steps", str(steps), "--out", str(out),
               "--threads", str(THREADS)]
    subprocess.run(command, check=True, capture_output=True, cwd=scratch, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    return statistics.median(json.loads(out.read_text())["step_time_s"][WARMUP:])


def per_call_costs(run_dir: Path) -> dict[str, float]:
    """Medians of the step-boundary calls, in seconds."""
    from ckptrun.runtime import collectives, records
    from ckptrun.runtime.liveness import Heartbeater

    heart = Heartbeater(run_dir, 0, 1, interval=3600.0)
    heart.beat(0, "train")
    record = {"step": 1, "attempt": 1, "loss": 2.302585092994046, "time": time.time(), "step_time_s": 0.004,
              "precision": "fp32", "saving": False, "samples_per_s": 8000.0, "lr": 0.003, "epoch": 0, "samples_seen": 32,
              "grad_norm": 1.2345, "clipped": True, "skipped": False, "zero_grad_fraction": 0.0}
    beat = records.Heartbeat(rank=0, pid=os.getpid(), attempt=1, step=1, phase="train", time=time.time())
    return {
        "heartbeat_check_s": median_of(lambda: heart.beat(1, "train"), CALLS * 5),
        "heartbeat_write_s": median_of(lambda: records.write_heartbeat(run_dir, beat.model_copy(update={"time": time.time()})), CALLS),
        "metrics_write_s": median_of(lambda: records.log_metrics(run_dir, record), CALLS),
        "stop_check_s": median_of(lambda: (run_dir / "stop").exists(), CALLS * 5),
        "shared_decisions_w1_s": median_of(lambda: collectives.all_reduce_sum([1.0, 0.0, 0.0, 0.0]), CALLS),
    }


def measure(scratch: Path, repeats: int, steps: int, all_reduce_s: list[float], heartbeat_interval: float = 1.0) -> dict[str, Figure]:
    scratch.mkdir(parents=True, exist_ok=True)
    index = [0]
    ab = interleave(repeats, {"with": lambda: {"template_step_s": template_step(scratch, steps, index)},
                              "without": lambda: {"plain_step_s": plain_step(scratch, steps)}})
    calls = interleave(repeats, {"calls": lambda: per_call_costs(scratch / "records")})
    reduce = all_reduce_s or [0.0] * repeats
    per_step, per_step_w1 = [], []
    for r in range(repeats):
        step = ab["template_step_s"][r]
        local = (2 * calls["heartbeat_check_s"][r] + calls["heartbeat_write_s"][r] * min(1.0, step / heartbeat_interval)
                 + calls["metrics_write_s"][r] + calls["stop_check_s"][r])
        per_step.append(local + reduce[r % len(reduce)])
        per_step_w1.append(local + calls["shared_decisions_w1_s"][r])
    figures = {key: Figure(values, "s", NA) for key, values in calls.items()}
    figures["shared_decisions_w1_s"].note = "the same all-reduce in a gloo group of one rank (torchrun --nproc-per-node 1)"
    figures["shared_decisions_s"] = Figure(reduce, "s", NA, world_size=2, note="collectives.all_reduce_sum of 4 floats, gloo, 2 ranks")
    figures["runtime_per_step_s"] = Figure(per_step, "s", NA, world_size=2,
                                           note=f"2 heartbeat checks + write x step/{heartbeat_interval:g}s + metrics + stop check + 2-rank all-reduce")
    figures["runtime_overhead"] = Figure(ratio_samples(per_step, ab["template_step_s"]), "x", NA, world_size=2,
                                         note="runtime_per_step_s (2-rank all-reduce) / template_step_s (1 rank): the conservative reading")
    figures["runtime_overhead_w1"] = Figure(ratio_samples(per_step_w1, ab["template_step_s"]), "x", NA,
                                            note="as runtime_overhead with the 1-rank all-reduce")
    figures["template_step_s"] = Figure(ab["template_step_s"], "s", NA, note=f"default template, python, {THREADS} thread, {steps} steps, median of steps > {WARMUP}")
    figures["plain_step_s"] = Figure(ab["plain_step_s"], "s", NA, note="bench/plain_job.py, same job without ckptrun")
    figures["template_ab_ratio"] = Figure(ratio_samples(ab["template_step_s"], ab["plain_step_s"]), "x", NA, note="template_step_s / plain_step_s per repeat")
    return figures
