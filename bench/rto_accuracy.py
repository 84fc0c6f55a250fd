"""How close is `ckptrun estimate-rto` to the recovery time a real fault then takes, per fault kind?

Per scenario and repeat, interleaved: run A is the default template under
`ckptrun launch` with the scenario's flags and no fault; `estimate-rto`
predicts its RTO before any failure (no history: teardown and start-up from a
no-op relaunch on the path a restart takes — a warm standby agent forking its
ranks, by default — restore from read bandwidth and the hash rate of the
ranks verifying as they read, verify as the supervisor's own check). Run B is
the same job with the scenario's fault; its `restart` event holds the measured
RTO (failure detected → first step after the restore, backoff included). The
ratio predicted ÷ measured is reported with its median, min and max, and each
component predicted vs measured shows which part of the model is off.

Scenarios (``--scenarios``, comma-separated):

  kill       a rank SIGKILLed after step --steps − 48: detection is one supervisor poll, teardown the
             crash's SIGKILL, restore from the newest durable snapshot
  hang       a rank silent after step --steps − 48 with --heartbeat-timeout 5s: detection is the heartbeat
             timeout + the stack-dump wait (the estimate's ``rto_hang_s``)
  memory     the kill, with --memory-every-steps 2: the restore is from the memory tier
  s3         the kill, with --ckpt-dir s3://… on a local moto_server (127.0.0.1): snapshots published in the
             object store; the restore takes the verified local staging copy (as by default)
  local-cache  the s3 kill, with --local-cache DIR: the restore reads the node's verified cache
  node-loss  two nodes and a hot spare on 127.0.0.1 (one rank each): node 1's rank hangs after step --steps − 48
             and its launcher is SIGKILLed; the leader judges the node lost after the node timeout
             (30 s here: the heartbeat timeout 60 s, capped) and promotes the spare, whose first attempt goes
             through the standby it kept warm (``rto_node_loss_s``;
             the predicted detect is the node timeout + the spare's promotion)
  peer-memory  node-loss with the memory tier on every launcher (--memory-every-steps 2, a memory dir each):
             the spare's rank restores node 1's shards from the replica in node 0's memory (tier peer-memory)

    python bench/rto_accuracy.py [--scenarios kill,hang,memory,s3,local-cache,node-loss,peer-memory] [--repeats 3] [--nproc 2] [--json]

--json prints ``{"scenarios": {"kill": {"ratio": {"median", "min", "max", "samples"}, "components":
{part: {"predicted", "measured"}}, "repeats": [...]}, …}, "load": […]}``. Snapshots are a few MiB and
just written, so every read is page-cached. Nothing here is asserted: the goal (issue 26) is every
scenario's median ratio within 0.75..1.25.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from common import free_port

PARTS = ("detect", "teardown", "verify", "backoff", "restart")
MEASURED_KEYS = {"detect": "detect_s", "teardown": "teardown_s", "verify": "verify_s", "backoff": "backoff_s",
                 "restart": "relaunch_to_first_step_s"}
GOAL = (0.75, 1.25)
FAULT_BEFORE_END = 48  # the fault's step: steps - 48 (200 steps: after 152, past a durable save at 150 and a memory one at 152)


@dataclass(frozen=True)
class Scenario:
    name: str
    flags: tuple[str, ...]
    fault: str  # {rank}: the last rank
    total_key: str = "rto_s"  # the estimate's total this fault kind takes


SCENARIOS = {
    "kill": Scenario("kill", (), "kill:rank={rank}:step={step}"),
    "hang": Scenario("hang", ("--heartbeat-timeout", "5s"), "hang:rank={rank}:step={step}", total_key="rto_hang_s"),
    "memory": Scenario("memory", ("--memory-every-steps", "2"), "kill:rank={rank}:step={step}"),
    "s3": Scenario("s3", ("--ckpt-dir", "{s3}"), "kill:rank={rank}:step={step}"),
    "local-cache": Scenario("local-cache", ("--ckpt-dir", "{s3}", "--local-cache", "{run_dir}-cache"),
                            "kill:rank={rank}:step={step}"),
}
OBJECT_STORE = ("s3", "local-cache")  # scenarios that need the moto server
NODE_SCENARIOS = ("node-loss", "peer-memory")  # three launchers on 127.0.0.1, node 1 lost
BUCKET = "ckptrun-rto-bench"


def start_object_store(scratch: Path):
    """A moto S3 server on 127.0.0.1 for the object-store scenarios, its client environment in ours (the
    launches inherit it, as a user's credentials and endpoint reach ckptrun); the server process."""
    import boto3
    from object_store import CREDENTIALS, start_server

    process, endpoint = start_server(scratch / "moto.log")
    os.environ.update(CREDENTIALS, AWS_ENDPOINT_URL=endpoint, FSSPEC_S3_ENDPOINT_URL=endpoint)
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
    return process


def ckptrun(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "ckptrun.cli.main", *args], capture_output=True, text=True, timeout=600)
    if check and result.returncode != 0:
        raise SystemExit(f"ckptrun {' '.join(args)} failed ({result.returncode}):\n{result.stderr[-2000:]}")
    return result


def launch(run_dir: Path, scenario: Scenario, nproc: int, steps: int, fault: str | None, budget: bool = False) -> None:
    """``budget``: with --rto-budget, so the launch makes its own estimate while it trains (the same model)."""
    where = {"s3": f"s3://{BUCKET}/{run_dir.name}", "run_dir": str(run_dir)}
    flags = ["launch", "--nproc-per-node", str(nproc), "--save-every-steps", "5", "--threads", "1",
             "--run-dir", str(run_dir), "--name", run_dir.name, *(flag.format(**where) for flag in scenario.flags)]
    flags += ["--inject-fault", fault.format(rank=nproc - 1, step=steps - FAULT_BEFORE_END)] if fault else []
    flags += ["--rto-budget", "1h"] if budget else []
    ckptrun(*flags, "--", "--steps", str(steps))


def events(run_dir: Path, name: str) -> list[dict]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, filter(str.strip, lines)) if e.get("event") == name]


def measured_restart(run_dir: Path) -> dict:
    restarts = events(run_dir, "restart")
    if not restarts or restarts[-1].get("rto_s") is None:
        raise SystemExit(f"{run_dir}: no restart event with a measured RTO")
    return restarts[-1]


def predicted_parts(estimate: dict, scenario: Scenario) -> dict[str, float]:
    parts = {part: float(estimate["components"][part]["value_s"] or 0.0) for part in PARTS}
    if scenario.name == "hang":  # the supervisor counts the stack dump in the hang's teardown
        detect = estimate["components"]["detect"]
        parts["detect"], parts["teardown"] = detect["hang_detect_s"], parts["teardown"] + detect["stack_dump_s"]
    return parts


def one_repeat(root: Path, scenario: Scenario, index: int, nproc: int, steps: int) -> dict:
    clean = root / f"{scenario.name}-clean-{index}"  # A: a clean run, then the estimate made on it (no history)
    launch(clean, scenario, nproc, steps, fault=None)
    estimate = json.loads(ckptrun("estimate-rto", str(clean), "--json").stdout)
    crashed = root / f"{scenario.name}-fault-{index}"  # B: the same job with the fault; the supervisor measures it
    launch(crashed, scenario, nproc, steps, fault=scenario.fault, budget=True)
    restart = measured_restart(crashed)
    in_launch = [e for e in events(crashed, "rto_estimate") if e.get("attempt") == 1 and e.get("rto_s") is not None]
    sources = [e.get("tier") or e.get("source") for e in events(crashed, "restore_source")]
    predicted = estimate["totals"][scenario.total_key]
    return {"predicted_s": predicted, "measured_s": restart["rto_s"], "ratio": predicted / restart["rto_s"],
            "predicted": predicted_parts(estimate, scenario),
            "measured": {part: float(restart.get(key) or 0.0) for part, key in MEASURED_KEYS.items()},
            "restore_sources": sources, "cause": restart.get("cause"),
            "in_launch_ratio": in_launch[-1]["rto_s"] / restart["rto_s"] if in_launch and scenario.name != "hang" else None}


def start_nodes(run_dir: Path, steps: int, fault: str | None, memory: bool = False) -> dict[str, subprocess.Popen]:
    """Node 0, node 1 and a hot spare of one job on 127.0.0.1, one rank each, each its own address; ``memory``:
    the memory tier every 2 steps on each, in a memory dir of its own (its "node's RAM")."""
    port = free_port()
    common = ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--run-dir", str(run_dir), "--name", run_dir.name,
              "--nproc-per-node", "1", "--threads", "1", "--save-every-steps", "5", "--heartbeat-timeout", "60s",
              *(["--inject-fault", fault] if fault else [])]
    job = ["--", "--num-workers", "0", "--steps", str(steps)]
    places = {"node0": ["--node-rank", "0"], "node1": ["--node-rank", "1"], "spare": ["--spare"]}
    procs = {}
    for index, (name, place) in enumerate(places.items()):
        log = open(run_dir.parent / f"{run_dir.name}-{name}.log", "wb")
        ram = ["--memory-every-steps", "2", "--memory-dir", str(run_dir.parent / f"{run_dir.name}-ram-{name}")] if memory else []
        procs[name] = subprocess.Popen([sys.executable, "-m", "ckptrun.cli.main", "launch", *place, *common, *ram,
                                        "--local-addr", f"127.0.0.{index + 1}", *job], stdout=log, stderr=subprocess.STDOUT)
    return procs


def wait_all(procs: dict[str, subprocess.Popen], names: tuple[str, ...], timeout_s: float = 300) -> None:
    try:
        for name in names:
            procs[name].wait(timeout=timeout_s)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def reached(run_dir: Path, step: int) -> bool:
    """Rank 0 finished ``step`` (its own loss line, written as each step ends; metrics.jsonl is shared in batches)."""
    metrics = run_dir / "losses-rank0.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return any(json.loads(line).get("step", 0) >= step for line in lines if line.strip().startswith("{"))


def node_loss_repeat(root: Path, index: int, steps: int, memory: bool = False) -> dict:
    """Node 1 lost after step steps − 48 (its rank hung, then its launcher SIGKILLed: a node gone without a word);
    the spare takes its place at once. The estimate is made on a clean run of the same three launchers.
    ``memory``: the peer-memory scenario (the spare restores node 1's shards from node 0's replica)."""
    name = "peer-memory" if memory else "node-loss"
    clean = root / f"{name}-clean-{index}"
    clean.mkdir(parents=True)
    wait_all(start_nodes(clean, steps, None, memory), ("node0", "node1", "spare"))
    estimate = json.loads(ckptrun("estimate-rto", str(clean), "--json").stdout)
    lost = root / f"{name}-fault-{index}"
    lost.mkdir(parents=True)
    fault_step = steps - FAULT_BEFORE_END
    procs = start_nodes(lost, steps, f"hang:rank=1:step={fault_step}:attempt=1", memory)
    deadline = time.monotonic() + 300
    while not reached(lost, fault_step) and time.monotonic() < deadline and procs["node0"].poll() is None:
        time.sleep(0.05)
    procs["node1"].kill()
    wait_all(procs, ("node0", "spare"))
    restart = measured_restart(lost)
    node = estimate["node_loss"]
    predicted = {part: float(estimate["components"][part]["value_s"] or 0.0) for part in PARTS}
    predicted["detect"] = node["detect_s"] + node["join"]["value_s"]
    predicted["restart"] = node["restart"]["value_s"] if node["restart"] else predicted["restart"]
    measured = {part: float(restart.get(key) or 0.0) for part, key in MEASURED_KEYS.items()}
    measured["detect"] += float(restart.get("node_join_s") or 0.0)  # the node's silence waited out, its replacement
    total = estimate["totals"]["rto_node_loss_s"]
    return {"predicted_s": total, "measured_s": restart["rto_s"], "ratio": total / restart["rto_s"],
            "predicted": predicted, "measured": measured,
            "restore_sources": [e.get("tier") for e in events(lost, "restore_source")], "cause": restart.get("cause"),
            "promoted": events(lost, "spare_promoted"), "restart_event": restart, "in_launch_ratio": None}


def summary(repeats: list[dict]) -> dict:
    ratios = [r["ratio"] for r in repeats]
    median = statistics.median(ratios)
    in_launch = [r["in_launch_ratio"] for r in repeats if r["in_launch_ratio"] is not None]
    return {"ratio": {"median": median, "min": min(ratios), "max": max(ratios), "samples": ratios},
            "in_launch_ratio": {"median": statistics.median(in_launch), "min": min(in_launch), "max": max(in_launch)}
            if in_launch else None,
            "within_goal": GOAL[0] <= median <= GOAL[1],
            "components": {part: {"predicted": statistics.median(r["predicted"][part] for r in repeats),
                                  "measured": statistics.median(r["measured"][part] for r in repeats)}
                           for part in PARTS},
            "repeats": repeats}


def report(document: dict) -> None:
    load = document["load"]
    print(f"world size {document['nproc']}; snapshots just written (page-cached); {document['repeats']} repeats per "
          f"scenario; load average {load[0]:.1f} before, {load[1]:.1f} after on {os.cpu_count()} CPUs\n")
    print(f"{'scenario':<11} {'measured':>9} {'predicted':>9}  {'ratio median (min..max)':<24} goal 0.75..1.25")
    for name, s in document["scenarios"].items():
        m = statistics.median(r["measured_s"] for r in s["repeats"])
        p = statistics.median(r["predicted_s"] for r in s["repeats"])
        r = s["ratio"]
        launched = s["in_launch_ratio"]
        print(f"{name:<11} {m:>8.2f}s {p:>8.2f}s  {r['median']:.2f} ({r['min']:.2f}..{r['max']:.2f}){'':<8} "
              f"{'PASS' if s['within_goal'] else 'MISS'}"
              + (f"   launch --rto-budget's own estimate: ratio {launched['median']:.2f}" if launched else ""))
    print("\nper component, median seconds (predicted | measured):")
    for name, s in document["scenarios"].items():
        cells = "  ".join(f"{part} {c['predicted']:.2f}|{c['measured']:.2f}" for part, c in s["components"].items())
        print(f"  {name:<8} {cells}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default="kill,hang,memory",
                        help=f"comma-separated: {', '.join((*SCENARIOS, *NODE_SCENARIOS))}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200, help=f"steps per run; the fault comes {FAULT_BEFORE_END} "
                        "before the end (seconds into the run: the next attempt's standby is ready, as in a real job)")
    parser.add_argument("--json", action="store_true", help="print every figure as one JSON document")
    args = parser.parse_args()
    chosen = [name.strip() for name in args.scenarios.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in (*SCENARIOS, *NODE_SCENARIOS)]
    if unknown:
        parser.error(f"unknown scenario {unknown[0]!r}: pick from {', '.join((*SCENARIOS, *NODE_SCENARIOS))}")
    load = os.getloadavg()[0]
    results: dict[str, list[dict]] = {name: [] for name in chosen}
    with tempfile.TemporaryDirectory(prefix="ckptrun-rto-bench-") as scratch, contextlib.ExitStack() as cleanup:
        if set(chosen) & set(OBJECT_STORE):
            server = start_object_store(Path(scratch))
            cleanup.callback(lambda: (server.kill(), server.wait()))
        for index in range(args.repeats):  # scenarios interleaved within each repeat
            for name in chosen:
                print(f"repeat {index + 1}/{args.repeats}: {name}", file=sys.stderr, flush=True)
                results[name].append(node_loss_repeat(Path(scratch), index, args.steps, memory=name == "peer-memory")
                                     if name in NODE_SCENARIOS else
                                     one_repeat(Path(scratch), SCENARIOS[name], index, args.nproc, args.steps))
    document = {"nproc": args.nproc, "repeats": args.repeats, "load": [load, os.getloadavg()[0]],
                "scenarios": {name: summary(repeats) for name, repeats in results.items()}}
    if args.json:
        print(json.dumps(document, indent=1))
    else:
        report(document)


if __name__ == "__main__":
    main()
