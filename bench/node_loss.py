"""Issue 25's last figures: node loss without durable storage, and what replicating costs training.

Two "nodes" on 127.0.0.1 (one `ckptrun launch` each, one gloo rank each, each its own --local-addr and
--memory-dir, one shared run dir), the FSDP2 template (``ckptrun init --template fsdp``: a small GPT; grow it
with --n-embd / --n-layer), durable snapshots every --save-every steps (default 20).

(A), (B): node 1 is lost. Rank 1 hangs after step --fault-step (odd, so the memory tier holds the step before,
newer than any durable one); once node 0 has its own memory copy and a verified replica of node 1's shards of
that step (or, with no memory tier, once rank 0 is there), node 1's launcher and its whole process tree are
SIGKILLed and its --memory-dir deleted. The leader's ``restart`` event holds the measured RTO (failure detected
→ first step after the restore) and its parts; each node's ``restore_source`` event its tier and durable bytes.

  peer-memory  memory tier every 2 steps, 1 replica; a new node-1 launcher started at once: node 1's shards
               come from node 0's replica (tier peer-memory, durable_bytes_read 0)
  durable      the same loss with no memory tier: both nodes restore the durable snapshot
  spare        memory tier as peer-memory, plus a --spare launcher waiting (a warm standby); the leader
               promotes it at once (node 1's --node-join-timeout stays 300 s)
  relaunch     no spare, node 1's launcher relaunched right after the loss: that is peer-memory's run, so
               its figures are the peer-memory samples (same tier: spare ÷ relaunch is the join and start-up)

The loss is seen as a rank failure on node 0 (its collective with the dead rank breaks: ``detect``), then
the leader waits out node 1's silence, the node timeout max(5, min(--heartbeat-timeout, 30)) s, and for its
replacement (``join``); both are reported apart from ``restore`` (rank 0's, which includes serving the
replica to node 1) so that the tier's difference is visible. With the template's defaults the snapshot is
~1 MiB: restores take milliseconds either way; --n-embd 256 makes it ~20 MiB (and steps slower).

(C): the same two nodes, no fault, 80 steps: rank 0's step_time_s (metrics.jsonl) from step 10 on, for
``none`` (no periodic save), ``durable-bg`` (--save-every-steps 2, async: persisted in the background),
``replicating`` (--memory-every-steps 2 --memory-replicas 1, no durable save). Slowdown = median step time ÷
``none``'s; the goal is replicating ÷ durable-bg ≤ 1.0 (PASS/MISS; means given too: a stall every 2nd step
can hide under a median).

    python bench/node_loss.py [--repeats 1] [--scenarios peer-memory,durable,spare,train] [--n-embd 64]
                              [--heartbeat-timeout 10s] [--scratch DIR] [--json]

Scenarios interleave within each repeat (order rotated); ratios are medians over repeats, from this run.
--json prints {"scenarios": {...}, "ratios": {...}, "load": [...]}. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from common import load_average
from rto_accuracy import free_port, measured_restart, reached

import ckptrun.templates
from ckptrun.cli.supervision.attempt import kill_all, processes_of_run
from ckptrun.runtime.records import read_events, read_metrics

TEMPLATES = Path(ckptrun.templates.__file__).parent
PARTS = {"detect": "detect_s", "join": "node_join_s", "teardown": "teardown_s", "verify": "verify_s",
         "backoff": "backoff_s", "startup": "startup_s", "restore": "restore_s", "first_step": "first_step_s"}
LOSS = ("peer-memory", "durable", "spare")
TRAIN = {"none": [], "durable-bg": ["--save-every-steps", "2", "--async-save"],
         "replicating": ["--memory-every-steps", "2", "--memory-replicas", "1"]}
WARMUP_STEPS = 10


class Cluster:
    """The launchers of one two-node job in ``root``: started in their own sessions, every tree killed at close."""

    def __init__(self, root: Path, args: argparse.Namespace) -> None:
        self.root, self.args, self.port = root, args, free_port()
        self.run_dir = root / "run"
        self.procs: dict[str, subprocess.Popen] = {}
        root.mkdir(parents=True)

    def flags(self, extra: list[str]) -> list[str]:
        """The flags every launcher of the job shares."""
        return ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--run-dir", str(self.run_dir),
                "--name", f"{self.root.name}-{self.port}", "--nproc-per-node", "1", "--threads", "1",
                "--heartbeat-timeout", self.args.heartbeat_timeout, "--restart-backoff", "0.1", *extra]

    def start(self, who: str, place: list[str], addr: int, extra: list[str]) -> subprocess.Popen:
        """One launcher: ``place`` is --node-rank K or --spare; its own address and memory dir."""
        log = open(self.root / f"{who}-{len(self.procs)}.log", "wb")
        job = job_command(self.args)
        command = [sys.executable, "-m", "ckptrun.cli.main", "launch", *place, *self.flags(extra),
                   "--local-addr", f"127.0.0.{addr}", "--memory-dir", str(self.root / f"ram-{who}"), *job]
        self.procs[who] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        return self.procs[who]

    def wait(self, names: tuple[str, ...], timeout_s: float = 400) -> dict[str, int | None]:
        """Exit codes of ``names`` (None: still running at the deadline)."""
        deadline, codes = time.monotonic() + timeout_s, {}
        for name in names:
            try:
                codes[name] = self.procs[name].wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[name] = None
        return codes

    def lose(self, who: str) -> None:
        """The node and its RAM gone: its launcher's whole tree SIGKILLed, then its memory dir deleted."""
        kill_tree(self.procs[who].pid)
        self.procs[who].wait()
        shutil.rmtree(self.root / f"ram-{who}", ignore_errors=True)

    def close(self) -> list[int]:
        """Kill every launcher's tree and whatever still carries the run's id; the pids that had to go."""
        for proc in self.procs.values():
            kill_tree(proc.pid)
            proc.poll()
        try:
            run_id = json.loads((self.run_dir / "run.json").read_text())["run_id"]
        except (OSError, ValueError, KeyError):
            return []
        left = processes_of_run(run_id)
        for process in left:
            kill_tree(process.pid)
        return [p.pid for p in left]


def job_command(args: argparse.Namespace) -> list[str]:
    """The training script and its flags: the FSDP2 template, or the default (DDP) template."""
    if args.job == "default":
        return [str(TEMPLATES / "default_job.py"), "--steps", str(args.steps), "--num-workers", "0", "--hidden", str(args.hidden)]
    return [str(TEMPLATES / "fsdp.py"), "--steps", str(args.steps), "--n-embd", str(args.n_embd), "--n-layer", str(args.n_layer)]


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant, found before any dies (none is reparented unseen): the
    supervisor's own ``kill_all``."""
    try:
        root = psutil.Process(pid)
        kill_all([root, *root.children(recursive=True)], wait=10.0)
    except psutil.NoSuchProcess:
        return


def wait_until(condition, timeout_s: float, what: str, cluster: Cluster) -> None:
    """Poll until ``condition()``; a launcher that exits or the deadline ends the repeat with a reason."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        dead = [name for name, proc in cluster.procs.items() if proc.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"waiting for {what}: " + (f"{dead} exited" if dead else f"timed out after {timeout_s:g}s"))
        time.sleep(0.05)


def has_event(run_dir: Path, name: str, **fields) -> bool:
    return any(all(e.get(k) == v for k, v in fields.items()) for e in read_events(run_dir, name))


def loss_repeat(root: Path, scenario: str, args: argparse.Namespace) -> dict:
    """One node loss in ``scenario``: the leader's measured RTO and parts, every node's restore source."""
    cluster = Cluster(root, args)
    memory = scenario != "durable"
    extra = ["--save-every-steps", str(args.save_every)]
    extra += ["--memory-every-steps", "2", "--memory-replicas", "1"] if memory else ["--memory-every-steps", "0"]
    fault = ["--inject-fault", f"hang:rank=1:step={args.fault_step}:attempt=1"]
    try:
        if scenario == "spare":
            cluster.start("spare", ["--spare"], 3, extra)
        cluster.start("node0", ["--node-rank", "0"], 1, [*extra, *fault])
        cluster.start("node1", ["--node-rank", "1"], 2, [*extra, *fault])
        held = args.fault_step - 1

        def ready() -> bool:
            if not reached(cluster.run_dir, args.fault_step):
                return False
            if not memory:
                return True
            return (has_event(cluster.run_dir, "replica_received", node=0, from_node=1, step=held)
                    and has_event(cluster.run_dir, "memory_saved", node=0, step=held))
        wait_until(ready, 300, f"step {args.fault_step} on rank 0" + (f", node 1's step {held} on node 0" if memory else ""),
                   cluster)
        if scenario == "spare":
            wait_until(lambda: (cluster.run_dir / "spares" / "spare-1.json").exists(), 60, "the spare's join", cluster)
        lost_at = time.time()
        cluster.lose("node1")
        if scenario != "spare":
            cluster.start("node1", ["--node-rank", "1"], 2, extra)  # the scheduler relaunches it at once
        codes = cluster.wait(("node0", "spare" if scenario == "spare" else "node1"))
    finally:
        leftover = cluster.close()
    return loss_figures(cluster.run_dir, lost_at, codes, leftover)


def loss_figures(run_dir: Path, lost_at: float, codes: dict, leftover: list[int]) -> dict:
    """The leader's last ``restart`` (the one that reached a step) and what came before it since the loss:
    a memory restore that failed to load is retried from durable storage, and that shows here."""
    restart = measured_restart(run_dir)
    restarts = [e for e in read_events(run_dir, "restart") if float(e["time"]) > lost_at]
    since = float(restarts[-2]["time"]) if len(restarts) > 1 else lost_at
    final = [{k: e.get(k) for k in ("node", "tier", "step", "durable_bytes_read", "bytes_moved", "peer")}
             for e in read_events(run_dir, "restore_source") if float(e["time"]) > since]
    first = [(e.get("node"), e.get("tier"), e.get("step")) for e in read_events(run_dir, "restore_source")
             if lost_at < float(e["time"]) and (len(restarts) < 2 or float(e["time"]) < float(restarts[0]["time"]))]
    failed = [f"attempt {e.get('attempt')}: {str(e.get('reason'))[:160]}" for e in read_events(run_dir, "restore_failed")]
    failed += [f"attempt {e.get('attempt')}: {(e.get('stderr_tail') or [e.get('exception')])[0][:160]}"
               for e in read_events(run_dir, "failure") if float(e["time"]) > lost_at and e.get("step") == 0]
    steps = [m["time"] for m in read_metrics(run_dir) if m.get("attempt") == restart.get("attempt") and "time" in m]
    restored = [e for e in read_events(run_dir, "restored") if e.get("attempt") == restart.get("attempt")]
    return {"rto_s": restart["rto_s"], "parts": {p: float(restart.get(k) or 0.0) for p, k in PARTS.items()},
            "kill_to_first_step_s": (min(steps) - lost_at) if steps else None, "restarts": len(restarts),
            "snapshot_step": restart.get("snapshot_step"), "restore_sources": final, "first_try": first,
            "restore_failures": failed, "snapshot_bytes": restored[-1].get("bytes") if restored else None,
            "peer_fetch_s": [e.get("seconds") for e in read_events(run_dir, "peer_fetched")],
            "promoted": len(read_events(run_dir, "spare_promoted")), "exit_codes": codes, "leftover_pids_killed": leftover}


def train_repeat(root: Path, variant: str, args: argparse.Namespace) -> dict:
    """Two nodes, no fault, ``variant``'s saves: rank 0's step times after the warm-up."""
    cluster = Cluster(root, args)
    steps_arg = args.train_steps
    extra = [*TRAIN[variant], "--no-standby"] + ([] if variant == "replicating" else ["--memory-every-steps", "0"])
    saved_steps, args.steps = args.steps, steps_arg
    try:
        cluster.start("node0", ["--node-rank", "0"], 1, extra)
        cluster.start("node1", ["--node-rank", "1"], 2, extra)
        codes = cluster.wait(("node0", "node1"))
    finally:
        args.steps = saved_steps
        leftover = cluster.close()
    times = [m["step_time_s"] for m in read_metrics(cluster.run_dir)
             if m.get("step_time_s") is not None and WARMUP_STEPS < m.get("step", 0) < steps_arg]
    if not times:
        raise RuntimeError(f"no step times ({codes})")
    replicas = read_events(cluster.run_dir, "replica_received")
    return {"median_step_s": statistics.median(times), "mean_step_s": statistics.fmean(times), "steps": len(times),
            "saves": len(read_events(cluster.run_dir, "snapshot_saved")) + len(read_events(cluster.run_dir, "memory_saved")),
            "replicas_received": len(replicas), "exit_codes": codes, "leftover_pids_killed": leftover}


def med(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarise(samples: dict[str, list[dict]]) -> dict:
    """Medians per scenario and the ratios of issue 25 (median ÷ median, same run)."""
    scenarios: dict[str, dict] = {}
    for name, runs in samples.items():
        good = [r for r in runs if "error" not in r]
        out: dict = {"repeats": runs, "errors": [r["error"] for r in runs if "error" in r]}
        if good and "rto_s" in good[0]:
            out["rto_s"] = med([r["rto_s"] for r in good])
            out["parts"] = {p: med([r["parts"][p] for r in good]) for p in PARTS}
            out["tiers"] = sorted({(s["node"], s["tier"], s["durable_bytes_read"]) for r in good for s in r["restore_sources"]},
                                  key=str)
        elif good:
            out.update(median_step_s=med([r["median_step_s"] for r in good]), mean_step_s=med([r["mean_step_s"] for r in good]))
        scenarios[name] = out
    if "peer-memory" in scenarios:
        scenarios["relaunch"] = {**scenarios["peer-memory"], "note": "the peer-memory runs (a relaunched node 1)"}
    get = lambda name, key: scenarios.get(name, {}).get(key)  # noqa: E731
    ratios: dict = {"peer_memory_over_durable": div(get("peer-memory", "rto_s"), get("durable", "rto_s")),
                    "spare_over_relaunch": div(get("spare", "rto_s"), get("relaunch", "rto_s"))}
    for part in ("restore", "join"):
        ratios[f"peer_memory_over_durable_{part}"] = div((get("peer-memory", "parts") or {}).get(part),
                                                         (get("durable", "parts") or {}).get(part))
    base = get("none", "median_step_s"), get("none", "mean_step_s")
    for variant in ("durable-bg", "replicating"):
        if variant in scenarios and base[0]:
            scenarios[variant]["slowdown"] = div(get(variant, "median_step_s"), base[0])
            scenarios[variant]["slowdown_mean"] = div(get(variant, "mean_step_s"), base[1])
    ratio = div(get("replicating", "slowdown"), get("durable-bg", "slowdown"))
    ratios["replicating_over_durable_slowdown"] = ratio
    ratios["replicating_over_durable_slowdown_mean"] = div(get("replicating", "slowdown_mean"), get("durable-bg", "slowdown_mean"))
    ratios["replicating_goal"] = None if ratio is None else "PASS" if ratio <= 1.0 else "MISS"
    return {"scenarios": scenarios, "ratios": ratios}


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def report(document: dict, args: argparse.Namespace) -> None:
    """The human tables."""
    s, r = document["scenarios"], document["ratios"]
    load = document["load"]
    print(f"two nodes on 127.0.0.1, one rank each, FSDP2 template (--n-embd {args.n_embd} --n-layer {args.n_layer}), "
          f"--heartbeat-timeout {args.heartbeat_timeout}; {args.repeats} repeat(s); load {load[0]:.1f} before, "
          f"{load[1]:.1f} after on {os.cpu_count()} CPUs\n")
    loss = [n for n in (*LOSS, "relaunch") if n in s]
    if loss:
        print(f"{'node loss':<12} {'RTO':>7}  " + " ".join(f"{p:>10}" for p in PARTS) + "  restore tiers (node, tier, durable bytes)")
        for name in loss:
            if "rto_s" not in s[name]:
                print(f"{name:<12} failed: {s[name]['errors']}")
                continue
            parts = " ".join(f"{fmt(s[name]['parts'][p]):>10}" for p in PARTS)
            print(f"{name:<12} {fmt(s[name]['rto_s']):>6}s  {parts}  {s[name]['tiers']}")
        mib = [x["snapshot_bytes"] for n in LOSS for x in s.get(n, {}).get("repeats", []) if x.get("snapshot_bytes")]
        print(f"  snapshot {fmt(med(mib) and med(mib) / 2**20)} MiB; parts are medians in seconds (restore: rank 0's)")
        print(f"  peer-memory ÷ durable: RTO {fmt(r['peer_memory_over_durable'])}, restore "
              f"{fmt(r['peer_memory_over_durable_restore'])}, join {fmt(r['peer_memory_over_durable_join'])}")
        print(f"  spare ÷ relaunch: RTO {fmt(r['spare_over_relaunch'])}\n")
    train = [n for n in TRAIN if n in s]
    if train:
        print(f"{'training':<12} {'median step':>12} {'slowdown':>9} {'mean step':>10} {'slowdown':>9}")
        for name in train:
            if "median_step_s" not in s[name]:
                print(f"{name:<12} failed: {s[name]['errors']}")
                continue
            print(f"{name:<12} {fmt(s[name]['median_step_s'], '.4f'):>11}s {fmt(s[name].get('slowdown', 1.0)):>9} "
                  f"{fmt(s[name]['mean_step_s'], '.4f'):>9}s {fmt(s[name].get('slowdown_mean', 1.0)):>9}")
        print(f"  replicating ÷ durable-bg slowdown: {fmt(r['replicating_over_durable_slowdown'])} (goal ≤ 1.0: "
              f"{r['replicating_goal'] or '-'}); by means {fmt(r['replicating_over_durable_slowdown_mean'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default="peer-memory,durable,spare,train",
                        help="comma-separated: peer-memory, durable, spare (relaunch = peer-memory's runs), train")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--steps", type=int, default=80, help="steps of a node-loss run")
    parser.add_argument("--fault-step", type=int, default=57, help="rank 1 hangs after it (odd, past a durable save)")
    parser.add_argument("--save-every", type=int, default=20, help="durable interval of the node-loss runs")
    parser.add_argument("--train-steps", type=int, default=80, help="steps of a training-slowdown run")
    parser.add_argument("--heartbeat-timeout", default="10s", help="sets the node timeout (≥ 5 s)")
    parser.add_argument("--n-embd", type=int, default=64, help="template width (256: a ~20 MiB snapshot)")
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--job", choices=("fsdp", "default"), default="fsdp",
                        help="fsdp: templates/fsdp.py (FSDP2 shards); default: templates/default_job.py (DDP, --hidden)")
    parser.add_argument("--hidden", type=int, default=640, help="the default template's width")
    parser.add_argument("--scratch", type=Path, help="keep every run dir and log here (default: a temp dir, deleted)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    chosen = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    names = [n for n in chosen if n in LOSS] + (list(TRAIN) if "train" in chosen else [])
    if len(names) != len(chosen) + (len(TRAIN) - 1 if "train" in chosen else 0):
        parser.error(f"unknown scenario in {args.scenarios!r}")
    load = load_average()[0]
    samples: dict[str, list[dict]] = {n: [] for n in names}
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="ckptrun-node-loss-"))
    try:
        for index in range(args.repeats):
            order = names[index % len(names):] + names[:index % len(names)]  # rotated per repeat
            for name in order:
                print(f"repeat {index + 1}/{args.repeats}: {name}", file=sys.stderr, flush=True)
                root = scratch / f"{name}-{index}"
                try:
                    sample = (loss_repeat if name in LOSS else train_repeat)(root, name, args)
                except (RuntimeError, SystemExit) as exc:
                    sample = {"error": str(exc)[:500]}
                print(f"  {json.dumps(sample)[:300]}", file=sys.stderr, flush=True)
                samples[name].append(sample)
    finally:
        if args.scratch is None:
            shutil.rmtree(scratch, ignore_errors=True)
    document = {**summarise(samples), "load": [load, load_average()[0]],
                "settings": {k: str(v) for k, v in vars(args).items()}}
    if args.json:
        print(json.dumps(document, indent=1, default=str))
    else:
        report(document, args)


if __name__ == "__main__":
    main()
