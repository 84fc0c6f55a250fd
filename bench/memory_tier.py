"""The memory tier: lost steps and RTO for one kill, with and without ``--memory-every-steps``.

The same job both ways (the embedded default job, 1 CPU rank, a durable
snapshot every ``--durable`` steps, rank 0 SIGKILLed after step ``--kill``),
the order rotated per repeat. From each run's ``restart`` event: the steps
lost (kill step − restored step), the RTO ckptrun measured (detect +
teardown + verify + relaunch to the first step) and the cost of the failure
(RTO + lost steps × the run's median step time). From its ``memory_saved``
and ``snapshot_saved`` events: what a memory save and a durable save cost the
loop (their stall), and the median step time with the tier against without.
Ratios are with ÷ without, per repeat.

    python bench/memory_tier.py                 # 3 repeats
    python bench/memory_tier.py --repeats 1 --json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import MEMORY, Figure, failed, interleave, ratio_samples

STEPS, DURABLE, MEMORY_EVERY, KILL = 40, 20, 2, 37


def one_run(scratch: Path, name: str, memory: bool, steps: int, durable: int, every: int, kill: int) -> dict[str, float]:
    """One launch; its figures from the run's own records."""
    from ckptrun.runtime.records import read_events, read_metrics

    tier = ["--memory-every-steps", str(every)] if memory else []
    command = [sys.executable, "-m", "ckptrun.cli.main", "launch", "--nproc-per-node", "1", "--name", name,
               "--save-every-steps", str(durable), *tier, "--inject-fault", f"kill:rank=0:step={kill}",
               "--heartbeat-timeout", "10", "--restart-backoff", "0", "--ranks-output", "none",
               "--", "--steps", str(steps), "--num-workers", "0"]
    done = subprocess.run(command, cwd=scratch, capture_output=True, text=True, timeout=600)
    run_dir = scratch / "runs" / name
    if done.returncode != 0:
        raise RuntimeError(f"{name}: exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
    restart = read_events(run_dir, "restart")[0]
    step_s = statistics.median(r["step_time_s"] for r in read_metrics(run_dir) if r.get("attempt") == 1 and r.get("step", 0) > 1)
    key = "with" if memory else "without"
    figures = {f"lost_steps_{key}": float(restart["lost_steps"]), f"rto_{key}_s": restart["rto_s"],
               f"failure_cost_{key}_s": restart["rto_s"] + restart["lost_steps"] * step_s, f"step_{key}_s": step_s}
    durable_stalls = [e["stall_s"] for e in read_events(run_dir, "snapshot_saved")]
    figures[f"durable_stall_{key}_s"] = statistics.median(durable_stalls)
    if memory:
        figures["memory_stall_s"] = statistics.median(e["stall_s"] for e in read_events(run_dir, "memory_saved"))
        figures["memory_write_s"] = statistics.median(e["write_s"] for e in read_events(run_dir, "memory_saved"))
    shutil.rmtree(run_dir, ignore_errors=True)
    return figures


def figures(scratch: Path, repeats: int = 3, steps: int = STEPS, durable: int = DURABLE, every: int = MEMORY_EVERY,
            kill: int = KILL) -> dict[str, Figure]:
    """Interleaved runs with and without the tier; every figure named ``memory_tier_*``."""
    scratch.mkdir(parents=True, exist_ok=True)
    counter = iter(range(10**6))
    try:
        samples = interleave(repeats, {
            "with": lambda: one_run(scratch, f"with-{next(counter)}", True, steps, durable, every, kill),
            "without": lambda: one_run(scratch, f"without-{next(counter)}", False, steps, durable, every, kill),
        })
    except Exception as exc:  # noqa: BLE001 - one failed launch: say why instead of numbers
        return {"memory_tier_error": failed(exc)}
    note = f"default job, 1 rank, durable every {durable}, memory every {every}, kill after step {kill}"
    out = {f"memory_tier_{k}": Figure(v, "steps" if k.startswith("lost") else "s", MEMORY, note=note)
           for k, v in samples.items()}
    for what in ("lost_steps", "rto", "failure_cost", "step"):
        suffix = "" if what == "lost_steps" else "_s"
        out[f"memory_tier_{what}_ratio"] = Figure(
            ratio_samples(samples[f"{what}_with{suffix}"], samples[f"{what}_without{suffix}"]), "ratio", MEMORY,
            note=f"with the memory tier ÷ without; {note}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--durable", type=int, default=DURABLE)
    parser.add_argument("--every", type=int, default=MEMORY_EVERY)
    parser.add_argument("--kill", type=int, default=KILL)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="ckptrun-bench-memory-"))
    try:
        result = figures(scratch, args.repeats, args.steps, args.durable, args.every, args.kill)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        print(json.dumps({k: f.to_json() | {"samples": f.samples} for k, f in result.items()}, indent=1))
        return 0
    for key, fig in result.items():
        shown = fig.error or f"median {fig.median:.4g} {fig.unit} (min {min(fig.samples):.4g}, max {max(fig.samples):.4g}, n {len(fig.samples)})"
        print(f"{key:36} {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
