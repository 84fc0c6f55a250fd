"""What the runtime adds to every training step of the default template, in total and part by part.

Three views, measured in the same run:

* **per-step runtime work** (``step_work.py``, 2 gloo ranks) — the loop a
  template runs around a stand-in step of the template's median step time,
  sharing the step facts every N steps with the N the 2-rank template runs
  chose (``decision_every_steps``, its ``decision_cadence`` event):
  everything between one step's compute and the next (``end_step``, the
  boundary and heartbeat of ``run.batches``, the data position), a mean per
  step, so a heartbeat written once a second counts for its share. A timed
  pass splits it into parts (``step_part_*_s``, ``share_*``); what no part
  covers is ``other`` (Python glue, the timers). ``runtime_overhead`` = that
  total ÷ the template's median step at 2 ranks (``template_step_w2_s``).
* **per call** — single calls of the pieces in this process (medians):
  heartbeat check and write, the metrics line, the stop check, the step hook
  of a plain script, and ``shared_decisions_s``: the synchronous all-reduce of
  four floats between two ranks that every step waited for before issue 13.
* **A/B** — the template against ``plain_job.py`` (the same job without
  ckptrun), interleaved: ``template_ab_ratio`` under ``python`` (1 rank) and
  ``template_ab_ratio_w2`` under ``torchrun --nproc-per-node 2`` (DDP over
  gloo), each the median step with ÷ without, per repeat. Steps 1..10
  (warm-up, the first-step precision report) are left out. Both sides run
  torch with one thread per rank: on a shared 2-core machine two OpenMP
  threads stall at every barrier another process preempts, which buries a 2%
  difference in noise. Both arms are timed by the same stopwatch
  (``step_clock.py``: torch's optimizer-step hook, wall and process CPU per
  step) and run with the same determinism (``plain_job.py --deterministic``,
  the runtime's default): before, each arm timed itself its own way and only
  the template ran deterministic. ``template_ab_cpu_ratio[_w2]`` compare CPU
  seconds per step, which other processes on a loaded machine barely move.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import NA, Figure, free_port, interleave, median_of, ratio_samples

HERE = Path(__file__).resolve().parent
WARMUP = 10
CALLS = 400
THREADS = 1
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
PARTS = ("shared_facts", "metrics_record", "metrics_write", "heartbeat", "stop_check", "save_bookkeeping",
         "anomaly_check", "data_position")


def _job_env(run_dir: Path) -> dict[str, str]:
    from ckptrun.runtime.env import RunEnv

    # fp32 like plain_job.py: `auto` would pick bf16 on AMX CPUs and compare two different jobs
    env = RunEnv(run_id="bench", run_dir=run_dir, threads=THREADS, precision="fp32").to_env()
    return {**os.environ, **env, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": str(THREADS)}


def _clocked(clock: Path) -> tuple[float, float]:
    """Median wall and CPU seconds per step (steps > WARMUP) of rank 0, from ``step_clock.py``."""
    steps = json.loads(clock.with_name(clock.name + ".rank0.json").read_text())
    return statistics.median(steps["wall_s"][WARMUP:]), statistics.median(steps["cpu_s"][WARMUP:])


def template_step(scratch: Path, steps: int, index: list[int], ranks: int = 1, chosen: list[int] | None = None) -> tuple[float, float]:
    """The template's median step, wall and CPU; ``chosen`` collects the N its ``decision_every_steps=auto`` chose."""
    from ckptrun.runtime.records import read_events

    index[0] += 1
    run_dir = scratch / f"template-{index[0]}"
    launcher = TORCHRUN if ranks > 1 else [sys.executable]
    clock = scratch / f"template-clock-{index[0]}"
    command = [*launcher, str(HERE / "step_clock.py"), "--out", str(clock), "-m", "ckptrun.templates.default_job",
               "--steps", str(steps)]
    subprocess.run(command, env=_job_env(run_dir), check=True, capture_output=True, cwd=scratch)
    if chosen is not None:
        chosen.extend([e["every_steps"] for e in read_events(run_dir, "decision_cadence")][-1:])  # the N it ended with
    return _clocked(clock)


def plain_step(scratch: Path, steps: int, ranks: int = 1) -> tuple[float, float]:
    """plain_job.py's median step, wall and CPU, deterministic as the runtime's default (``RunEnv.deterministic``)."""
    clock = scratch / "plain-clock"
    launcher = TORCHRUN if ranks > 1 else [sys.executable]
    command = [*launcher, str(HERE / "step_clock.py"), "--out", str(clock), str(HERE / "plain_job.py"), "--steps", str(steps),
               "--out", str(scratch / "plain-steps.json"), "--threads", str(THREADS), "--deterministic"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": str(THREADS)}
    subprocess.run(command, check=True, capture_output=True, cwd=scratch, env=env)
    return _clocked(clock)


def per_call_costs(run_dir: Path) -> dict[str, float]:
    """Medians of single calls of the step-boundary pieces, in seconds."""
    from ckptrun.runtime import records
    from ckptrun.runtime.env import RunEnv
    from ckptrun.runtime.worker.liveness import Heartbeater
    from ckptrun.runtime.worker.step_hook import StepHook

    heart = Heartbeater(run_dir, 0, 1, interval=3600.0)
    heart.beat(0, "train")
    record = {"step": 1, "attempt": 1, "loss": 2.302585092994046, "time": time.time(), "step_time_s": 0.004,
              "precision": "fp32", "saving": False, "samples_per_s": 8000.0, "lr": 0.003, "epoch": 0, "samples_seen": 32,
              "grad_norm": 1.2345, "clipped": True, "skipped": False, "zero_grad_fraction": 0.0}
    beat = records.Heartbeat(rank=0, pid=os.getpid(), attempt=1, step=1, phase="train", time=time.time())
    metrics = records.JsonlAppender(run_dir / "metrics-bench.jsonl")
    hook = StepHook(RunEnv(run_id="bench", run_dir=run_dir), 0)  # a runtime heartbeater exists: it returns at once
    stop_file = run_dir / "stop"
    costs = {
        "heartbeat_check_s": median_of(lambda: heart.beat(1, "train"), CALLS * 5),
        "heartbeat_write_s": median_of(lambda: records.write_heartbeat(run_dir, beat.model_copy(update={"time": time.time()})), CALLS),
        "metrics_write_s": median_of(lambda: metrics.append(record), CALLS),
        "metrics_write_reopen_s": median_of(lambda: records.log_metrics(run_dir, record), CALLS),
        "stop_check_s": median_of(stop_file.exists, CALLS * 5),
        "step_hook_call_s": median_of(lambda: hook(None, (), {}), CALLS * 5),
    }
    metrics.close()
    return costs


def step_work(scratch: Path, repeats: int, step_s: float, steps: int = 300, every: str = "auto") -> dict[str, list[float]]:
    """The 2-rank per-step runtime work and its parts (step_work.py), per repeat, sharing facts every ``every`` steps."""
    port = free_port()
    command = [sys.executable, str(HERE / "step_work.py"), "--port", str(port), "--world", "2", "--steps", str(steps),
               "--decision-every", every,
               "--repeats", str(repeats), "--step-ms", f"{step_s * 1e3:.3f}", "--run-dir", str(scratch / "step-work")]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": str(THREADS)}
    procs = [subprocess.Popen([*command, "--rank", str(rank)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, cwd=scratch) for rank in range(2)]
    outputs = [proc.communicate(timeout=900) for proc in procs]
    for proc, (_, err) in zip(procs, outputs):
        if proc.returncode != 0:
            raise RuntimeError(f"step_work.py failed ({proc.returncode}): {err.strip().splitlines()[-1] if err.strip() else ''}")
    report = json.loads(outputs[0][0].strip().splitlines()[-1])
    samples = {"runtime_per_step_s": report["runtime_per_step_s"], "timed_per_step_s": report["timed_per_step_s"],
               "decision_every_steps": [float(report["decision_every_steps"])] * len(report["runtime_per_step_s"])}
    samples.update({f"step_part_{part}_s": report["parts_s"][part] for part in PARTS})
    samples["step_part_other_s"] = [max(0.0, total - sum(report["parts_s"][p][r] for p in PARTS))
                                    for r, total in enumerate(report["timed_per_step_s"])]
    return samples


def measure(scratch: Path, repeats: int, steps: int, sync_all_reduce_s: list[float]) -> dict[str, Figure]:
    scratch.mkdir(parents=True, exist_ok=True)
    index, chosen = [0], []
    ab = interleave(repeats, {
        "with": lambda: dict(zip(("template_step_s", "template_cpu_step_s"), template_step(scratch, steps, index))),
        "without": lambda: dict(zip(("plain_step_s", "plain_cpu_step_s"), plain_step(scratch, steps))),
        "with_w2": lambda: dict(zip(("template_step_w2_s", "template_cpu_step_w2_s"),
                                    template_step(scratch, steps, index, ranks=2, chosen=chosen))),
        "without_w2": lambda: dict(zip(("plain_step_w2_s", "plain_cpu_step_w2_s"), plain_step(scratch, steps, ranks=2))),
    })
    calls = interleave(repeats, {"calls": lambda: per_call_costs(scratch / "records")})
    every = str(round(statistics.median(chosen))) if chosen else "auto"  # the N the 2-rank template ran with
    work = step_work(scratch, repeats, statistics.median(ab["template_step_w2_s"]), steps=max(100, steps), every=every)
    figures = {key: Figure(values, "s", NA) for key, values in calls.items()}
    figures["metrics_write_s"].note = "one line to metrics.jsonl kept open (JsonlAppender)"
    figures["metrics_write_reopen_s"].note = "the same line with open + write + close per line (before issue 13)"
    figures["step_hook_call_s"].note = "the bootstrap's optimizer-step hook once the runtime heartbeats (returns at once)"
    if sync_all_reduce_s:
        figures["shared_decisions_s"] = Figure(sync_all_reduce_s, "s", NA, world_size=2,
                                               note="synchronous all_reduce_sum of 4 floats, 2 gloo ranks: what each step waited for before issue 13")
    figures["runtime_per_step_s"] = Figure(work["runtime_per_step_s"], "s", NA, world_size=2,
                                           note="step_work.py: mean runtime time per step around a stand-in step of template_step_w2_s")
    figures["decision_every_steps"] = Figure(work["decision_every_steps"], "x", NA, world_size=2,
                                             note="N of step_work.py: the one decision_every_steps=auto chose in the 2-rank template runs")
    for part in (*PARTS, "other"):
        key = f"step_part_{part}_s"
        figures[key] = Figure(work[key], "s", NA, world_size=2, note=f"{part}: mean per step (timed pass)")
        figures[f"share_{part}"] = Figure(ratio_samples(work[key], work["timed_per_step_s"]), "x", NA, world_size=2,
                                          note=f"{part} / the timed pass's total per step")
    figures["template_step_s"] = Figure(ab["template_step_s"], "s", NA, note=f"default template, python, {THREADS} thread, {steps} steps, median of steps > {WARMUP} (step_clock.py)")
    figures["plain_step_s"] = Figure(ab["plain_step_s"], "s", NA, note="bench/plain_job.py --deterministic, same job without ckptrun")
    figures["template_ab_ratio"] = Figure(ratio_samples(ab["template_step_s"], ab["plain_step_s"]), "x", NA, note="template_step_s / plain_step_s per repeat")
    figures["template_step_w2_s"] = Figure(ab["template_step_w2_s"], "s", NA, world_size=2, note="the template under torchrun, 2 ranks, DDP over gloo")
    figures["plain_step_w2_s"] = Figure(ab["plain_step_w2_s"], "s", NA, world_size=2, note="plain_job.py under torchrun, 2 ranks, DDP over gloo")
    figures["template_ab_ratio_w2"] = Figure(ratio_samples(ab["template_step_w2_s"], ab["plain_step_w2_s"]), "x", NA, world_size=2,
                                             note="template_step_w2_s / plain_step_w2_s per repeat")
    for suffix, world in (("", 1), ("_w2", 2)):  # CPU seconds: what the step costs, barely moved by other processes
        figures[f"template_cpu_step{suffix}_s"] = Figure(ab[f"template_cpu_step{suffix}_s"], "s", NA, world_size=world,
                                                         note="rank 0's process CPU per step (step_clock.py)")
        figures[f"plain_cpu_step{suffix}_s"] = Figure(ab[f"plain_cpu_step{suffix}_s"], "s", NA, world_size=world,
                                                      note="the same for plain_job.py")
        figures[f"template_ab_cpu_ratio{suffix}"] = Figure(
            ratio_samples(ab[f"template_cpu_step{suffix}_s"], ab[f"plain_cpu_step{suffix}_s"]), "x", NA, world_size=world,
            note=f"template_cpu_step{suffix}_s / plain_cpu_step{suffix}_s per repeat")
    figures["runtime_overhead"] = Figure(ratio_samples(work["runtime_per_step_s"], ab["template_step_w2_s"]), "x", NA, world_size=2,
                                         note="runtime_per_step_s / template_step_w2_s per repeat")
    return figures
