"""Restart side by side: kill → first step on both ranks under ckptrun, NVIDIA's ft_launcher and torchrun.

The same 2-rank CPU/gloo job (``peer_job.py``: ~0.9M params, two loader
workers per rank, a verified snapshot every 5 steps) runs under each launcher
in turn, the order rotated per round. In each run one rank is SIGKILLed once
it has made ``--kill-step`` steps; the figure is the time from the kill to the
first optimizer step that *both* ranks of the new generation completed, read
from the job's own step log (one JSON line per rank and step, with its time
and pid) the same way for all three. A run counts as a successful restart when
the job then completes (launcher exit 0, both ranks at the last step) within
``--deadline`` seconds.

* ckptrun: ``ckptrun launch --max-restarts 1`` (its own restart loop; the
  supervisor verifies the snapshot and names it; the restart goes through
  the warm standby agent, whose ranks are forked past ``import torch``: warm
  workers). Only with ``--only``: ``ckptrun-spawn`` (``--no-warm-workers``: the
  standby, each rank a new interpreter) and ``ckptrun-cold``
  (``--no-standby --no-warm-workers``: a new agent and new interpreters).
* ft_launcher (pip ``nvidia-resiliency-ext``, the ``bench`` extra):
  ``--standalone --max-restarts 1``; with c10d rendezvous it hands each round
  a fresh store (``TORCHELASTIC_USE_AGENT_STORE=False``) by itself.
* torchrun: ``--standalone --max-restarts 1`` with
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (with the shared store on, 4–6 of
  10 in-place restarts succeed here).

Under the peers the job's runtime picks and verifies the newest snapshot
itself (rank 0 verifies, broadcasts). Goal (issue 13 item 5): ckptrun ÷
ft_launcher ≤ 1.0.

    python bench/peer_restart.py --quick        # 1 round
    python bench/peer_restart.py --full         # 5 rounds
    python bench/peer_restart.py --rounds 3 --only ckptrun,ft_launcher --json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
JOB = HERE / "peer_job.py"
BIN = Path(sys.executable).parent
MARK = "PEER_RESTART_BENCH_RUN"  # not a CKPTRUN_ name (ckptrun strips those): every process of one run carries it, for the last sweep
MODES = {"quick": 1, "full": 5}
LAUNCHERS = ("ckptrun", "ckptrun-spawn", "ckptrun-cold", "ft_launcher", "torchrun")  # -spawn, -cold: only when asked
CKPTRUN_VARIANTS = {"ckptrun": [], "ckptrun-spawn": ["--no-warm-workers"], "ckptrun-cold": ["--no-standby", "--no-warm-workers"]}
DEFAULT = ("ckptrun", "ft_launcher", "torchrun")
GOAL = 1.0


def narrate(text: str) -> None:
    print(f"[peer-restart {time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.2f}] {text}", file=sys.stderr, flush=True)


# --- the three launchers ---------------------------------------------------------------


def job_args(args: argparse.Namespace, step_log: Path) -> list[str]:
    return [str(JOB), "--steps", str(args.steps), "--step-log", str(step_log), "--step-sleep", str(args.step_sleep)]


def peer_env(work: Path) -> dict[str, str]:
    """What ckptrun launch would hand the job, for the peers (unsupervised: the runtime verifies by itself)."""
    from ckptrun.runtime.env import RunEnv

    return RunEnv(run_id=work.name, run_dir=work / "run", save_every_steps=5, threads=1).to_env()


def command(launcher: str, args: argparse.Namespace, work: Path, step_log: Path) -> tuple[list[str], dict[str, str]]:
    """The command line and extra environment of one run under ``launcher``."""
    job = job_args(args, step_log)
    if launcher.startswith("ckptrun"):
        cold = CKPTRUN_VARIANTS[launcher]
        return ([sys.executable, "-m", "ckptrun.cli.main", "launch", "--nproc-per-node", "2", "--threads", "1",
                 "--save-every-steps", "5", "--max-restarts", "1", "--run-dir", str(work / "run"), "--name", work.name,
                 "--ranks-output", "none", *cold, *args.ckptrun_flags, *job], {})
    if launcher == "ft_launcher":
        return ([str(BIN / "ft_launcher"), "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                 "--ignore-missing-fault-tol-cfg", *job], {**peer_env(work), "TORCHELASTIC_USE_AGENT_STORE": "False"})
    return ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
             "--max-restarts", "1", *job], {**peer_env(work), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})


# --- one run -----------------------------------------------------------------------------


def read_steps(step_log: Path) -> list[dict[str, Any]]:
    try:
        lines = step_log.read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line being written
    return out


def wait_for(predicate: Any, deadline: float, process: subprocess.Popen, poll: float = 0.02) -> Any:
    """``predicate()`` once truthy; None at the deadline or once the launcher has exited (and it is still falsy)."""
    while time.time() < deadline:
        ended = process.poll() is not None
        found = predicate()
        if found or ended:
            return found or None
        time.sleep(poll)
    return None


def first_new_steps(step_log: Path, old_pids: set[int], after: float) -> dict[int, dict[str, Any]] | None:
    """Each rank's first step of the new generation (a pid that was not there before the kill), once both have one."""
    firsts: dict[int, dict[str, Any]] = {}
    for line in read_steps(step_log):
        if line["pid"] not in old_pids and line["time"] > after:
            firsts.setdefault(line["rank"], line)
    return firsts if len(firsts) >= 2 else None


def one_run(launcher: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    work = root / f"{launcher}-{uuid.uuid4().hex[:6]}"
    work.mkdir(parents=True)
    step_log = work / "steps.jsonl"
    argv, extra = command(launcher, args, work, step_log)
    env = {**os.environ, **extra, MARK: work.name, "PYTHONWARNINGS": "ignore"}
    deadline = time.time() + args.deadline
    with open(work / "launcher.log", "wb") as log:
        process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   cwd=HERE.parent, start_new_session=True)
    result: dict[str, Any] = {"launcher": launcher, "rto_s": None, "ok": False}
    try:
        victim = wait_for(lambda: next((s for s in read_steps(step_log) if s["rank"] == args.kill_rank
                                        and s["step"] >= args.kill_step), None), deadline, process)
        if victim is None:
            return {**result, "error": f"rank {args.kill_rank} never reached step {args.kill_step}"}
        old_pids = {s["pid"] for s in read_steps(step_log)}
        killed_at = time.time()
        os.kill(victim["pid"], signal.SIGKILL)
        firsts = wait_for(lambda: first_new_steps(step_log, old_pids, killed_at), deadline, process)
        if firsts is None:
            return {**result, "error": f"no first step on both ranks after the kill (launcher exit {process.poll()}); "
                                       f"see {work / 'launcher.log'} with --keep"}
        result["rto_s"] = max(s["time"] for s in firsts.values()) - killed_at
        try:
            code = process.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            return {**result, "error": "the restarted job did not finish (hung)"}
        last = {r: max((s["step"] for s in read_steps(step_log) if s["rank"] == r), default=0) for r in (0, 1)}
        result["ok"] = code == 0 and min(last.values()) >= args.steps
        result["error"] = None if result["ok"] else f"exit {code}, last steps {last}"
        result["restored"] = restored_timeline(work / "run", killed_at)
        return result
    finally:
        sweep(process, work.name)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def restored_timeline(run_dir: Path, killed_at: float) -> dict[str, float] | None:
    """The runtime's ``restored`` event of the new generation: its start-up milestones, in seconds after the kill."""
    try:
        events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return None
    restored = [e for e in events if e.get("event") == "restored"]
    if not restored:
        return None
    marks = restored[-1].get("startup") or {}
    out = {name: round(float(t) - killed_at, 3) for name, t in marks.items()}
    out["restored"] = round(float(restored[-1]["time"]) - killed_at, 3) if "time" in restored[-1] else None
    return out


def sweep(process: subprocess.Popen, mark: str) -> None:
    """Kill the launcher and every process that carries this run's mark (ranks run in sessions of their own)."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except OSError:
            pass
        process.wait()
    for _ in range(2):
        left = []
        for candidate in psutil.process_iter():
            try:
                if candidate.environ().get(MARK) == mark:
                    candidate.kill()
                    left.append(candidate)
            except psutil.Error:
                continue
        psutil.wait_procs(left, timeout=5)


# --- rounds and the report -----------------------------------------------------------------


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """``args.rounds`` rounds, each running every launcher once in an order rotated per round."""
    launchers = [name for name in LAUNCHERS if name in args.only]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in launchers}
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="ckptrun-peer-restart-") as scratch:
        root = Path(args.keep_dir) if args.keep else Path(scratch)
        for index in range(args.rounds):
            shift = index % len(launchers)
            for name in launchers[shift:] + launchers[:shift]:
                narrate(f"round {index + 1}/{args.rounds}: {name}")
                result = one_run(name, args, root)
                narrate(f"  {name}: kill → first step {fmt(result['rto_s'])}"
                        f"{'' if result['ok'] else ' FAILED: ' + str(result.get('error'))}")
                runs[name].append(result)
    return {"rounds": args.rounds, "load_avg": [load_start, os.getloadavg()[0]], "cpus": os.cpu_count(),
            "runs": runs, "summary": summarise(runs)}


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for name, results in runs.items():
        samples = [r["rto_s"] for r in results if r["rto_s"] is not None and r["ok"]]
        spawned = [r["restored"]["process"] for r in results if r["ok"] and (r.get("restored") or {}).get("process") is not None]
        summary[name] = {"median_s": statistics.median(samples) if samples else None,
                         "min_s": min(samples, default=None), "max_s": max(samples, default=None),
                         "succeeded": sum(r["ok"] for r in results), "runs": len(results), "samples": samples,
                         "spawned_median_s": statistics.median(spawned) if spawned else None}
    ours = summary.get("ckptrun", {}).get("median_s")
    for peer in ("ckptrun-spawn", "ckptrun-cold", "ft_launcher", "torchrun"):
        theirs = summary.get(peer, {}).get("median_s")
        summary[f"ckptrun / {peer}"] = ours / theirs if ours and theirs else None
    return summary


def fmt(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f}s"


def report(results: dict[str, Any]) -> None:
    summary = results["summary"]
    print(f"kill → first step on both ranks, 2 ranks CPU/gloo, {results['rounds']} interleaved round(s); "
          f"load average {results['load_avg'][0]:.2f} → {results['load_avg'][1]:.2f} on {results['cpus']} CPUs")
    print(f"{'launcher':12} {'median':>8} {'min':>8} {'max':>8}  restarts ok  new rank 0 process (median)")
    for name in LAUNCHERS:
        if name in summary:
            s = summary[name]
            print(f"{name:12} {fmt(s['median_s']):>8} {fmt(s['min_s']):>8} {fmt(s['max_s']):>8}  "
                  f"{s['succeeded']}/{s['runs']:<9}  {fmt(s['spawned_median_s'])}")
    print("(new rank 0 process: its psutil start time after the kill, the part a launcher controls; a common offset "
          "of up to 1 s, since the boot time psutil adds is whole seconds)")
    for peer in ("ckptrun-spawn", "ckptrun-cold", "ft_launcher", "torchrun"):
        ratio = summary.get(f"ckptrun / {peer}")
        if ratio is not None:
            verdict = "" if peer.startswith("ckptrun") else f"  (goal ≤ {GOAL:.1f}×: {'PASS' if ratio <= GOAL else 'MISS'})"
            print(f"ckptrun ÷ {peer:12} {ratio:.2f}×{verdict}")


def figures(rounds: int) -> dict[str, Any]:
    """The figures ``run.py --full`` adds to its size-independent table (one :class:`common.Figure` per key)."""
    from common import NA, Figure, failed

    args = parse(["--rounds", str(rounds)])
    try:
        runs = measure(args)["runs"]
    except Exception as exc:  # noqa: BLE001 - a broken peer must not hide the other figures
        return {"restart_ckptrun_s": failed(exc)}
    out: dict[str, Any] = {}
    for name, results in runs.items():
        samples = [r["rto_s"] for r in results if r["ok"] and r["rto_s"] is not None]
        note = f"kill -> first step on both ranks under {name}; {sum(r['ok'] for r in results)}/{len(results)} restarts ok"
        out[f"restart_{name}_s"] = Figure(samples, "s", NA, 2, note) if samples else failed(
            next((r.get("error") for r in results if r.get("error")), "no sample"), world_size=2)
        out[f"restart_ok_{name}"] = Figure([float(r["ok"]) for r in results], "ratio", NA, 2, f"restarts that succeeded under {name}")
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_const", const="quick", dest="mode", help="1 round")
    mode.add_argument("--full", action="store_const", const="full", dest="mode", help="5 rounds")
    parser.add_argument("--rounds", type=int, help="rounds (each runs every launcher once); overrides the mode")
    parser.add_argument("--only", default=",".join(DEFAULT),
                        help=f"comma-separated launchers to run, of {', '.join(LAUNCHERS)} (default: {', '.join(DEFAULT)})")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kill-step", type=int, default=40, help="a few seconds in: long enough for a standby to be warm")
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--step-sleep", type=float, default=0.05)
    parser.add_argument("--deadline", type=float, default=180.0, help="seconds one run may take in all")
    parser.add_argument("--ckptrun-flags", default="", help="extra `ckptrun launch` flags, e.g. '--no-standby'")
    parser.add_argument("--keep", action="store_true", help="keep every run's files under --keep-dir")
    parser.add_argument("--keep-dir", default="bench/results/peer-restart")
    parser.add_argument("--json", action="store_true", help="print every figure as one JSON document")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or MODES[args.mode or "quick"]
    args.only = [name.strip() for name in args.only.split(",") if name.strip()]
    args.ckptrun_flags = args.ckptrun_flags.split()
    if not (BIN / "ft_launcher").exists() and "ft_launcher" in args.only:
        narrate("ft_launcher is not installed (pip install -e '.[bench]'): skipping it")
        args.only.remove("ft_launcher")
    return args


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: every run's processes are swept
    args = parse(argv)
    results = measure(args)
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
