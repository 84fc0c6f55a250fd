"""``estimate-rto --nodes N``: the recovery budget projected to a size this machine is not, each part marked.

Every figure starts from what was measured here on this run (the components
of :mod:`~ckptrun.cli.recovery_budget.estimate`, a restore timed on this
snapshot's files, a job-store round trip timed now) and is carried to N nodes
of G ranks holding S bytes by how that part scales. A part is ``measured``
when it does not depend on the size (a node's own crash detection, its local
teardown, a process start through the standby: each node does them at once)
and ``modelled`` otherwise, with its model in ``how``:

- restore: each node reads its S/N bytes at this machine's measured read rate
  and hashes them at the measured per-thread rate on min(CPUs, G × hash
  threads) threads, the slower of the two (they overlap); a shared file
  system's aggregate bandwidth, not known here, caps it further;
- verify: the supervisor's share of that node's files at the rule it applies
  (manifest and sizes: unchanged per node; whole-file digests: S/N at the
  rate measured on this snapshot);
- the leader's decisions: a failure reaches every node in three hops (every
  node's failure alarm rings, the leader sees every teardown acknowledgement
  with the node's verdict on its share of the snapshot, every node reads the
  next attempt); each waiter blocks on the key it expects, so a hop ends with
  its writer's key, not at a poll (:mod:`ckptrun.cli.supervision.job_store`),
  but in each hop the one store serves every node's read in series: 3·N round
  trips, added to teardown — a lower bound (a verify round the acks did not
  settle adds two). ``bench/control_plane.py`` runs the real leader against N
  simulated nodes: 0.015 s at 8 nodes here (the model: 2 ms), 0.69 s (p50) at
  1,024 with all 1,024 nodes' CPU on 2 cores;
- process-group start-up: every one of the N·G ranks makes at least two round
  trips to the one rendezvous store (its own key, the shared id), served in
  series — a lower bound: NCCL's communicator set-up on GPUs is not modelled
  (no GPU here);
- the save: staging copies each rank's S/(N·G) bytes, so the stall and the
  background persist scale with the bytes per rank from this run's;
- the MTBF of the job is ``--mtbf-per-node`` ÷ N (independent node failures),
  which sets Daly's interval and the goodput at that size.

The same arithmetic as the measured estimate (:mod:`rto_model`). Importable without torch (the store round
trip imports it when timed).
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

from ckptrun.cli.durations import format_duration as fmt
from ckptrun.cli.recovery_budget.rto_model import daly, goodput
from ckptrun.runtime.checkpoint.verified_read import HASH_THREADS

MEASURED, MODELLED, CONFIGURED = "measured", "modelled", "configured"  # configured: the restart policy
STORE_SAMPLE_OPS = 400  # set+get pairs timed against a loopback TCPStore
SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgtp]?)(i?)b?\s*$", re.I)


def parse_size(text: str) -> int:
    """``1.1T``, ``500GB``, ``64GiB``, ``123456``: bytes (K/M/G/T/P decimal; with ``i`` binary)."""
    match = SIZE.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a size (for example 1.1T, 500GB or 64GiB)")
    number, unit, binary = float(match.group(1)), match.group(2).lower(), bool(match.group(3))
    power = "kmgtp".index(unit) + 1 if unit else 0
    return int(number * (1024 if binary else 1000) ** power)


DECISION_HOPS = 3  # failure heard by every node -> acks (with verify verdicts) seen by the leader -> next attempt read


def store_round_trip_s(ops: int = STORE_SAMPLE_OPS) -> float:
    """One set or get against a TCPStore on loopback, timed now (the leader's store is one)."""
    from ckptrun.cli.supervision.job_store import _tcp_store

    server = _tcp_store("127.0.0.1", 0, True, 10.0)
    client = _tcp_store("127.0.0.1", server.port, False, 10.0)
    started = time.perf_counter()
    for i in range(ops):
        client.set(f"probe/{i}", "x" * 64)
        client.get(f"probe/{i}")
    return (time.perf_counter() - started) / (2 * ops)


def project(document: dict[str, Any], restore: dict[str, Any], nodes: int, gpus_per_node: int, state_bytes: int,
            mtbf_per_node_s: float | None, round_trip_s: float, cpus: int | None = None) -> dict[str, Any]:
    """The projection of ``document`` (the measured report) to ``nodes`` × ``gpus_per_node`` ranks and
    ``state_bytes``; ``restore`` holds the restore facts measured here (:func:`rto_components.restore_estimate`,
    its ``restore_s`` the restore inside the measured restart figure)."""
    cpus = cpus or os.cpu_count() or 1
    here = document["components"]
    ranks = nodes * gpus_per_node
    per_node, per_rank = state_bytes / nodes, state_bytes / ranks
    here_bytes, here_world = document["snapshot"]["bytes"], document["snapshot"]["world_size"]
    here_per_rank = here_bytes / max(1, here_world)
    parts: dict[str, dict[str, Any]] = {}

    def part(name: str, value: float | None, mark: str, how: str) -> None:
        parts[name] = {"value_s": value, "mark": mark, "how": how}

    detect = here["detect"]
    part("detect", detect["value_s"], MEASURED, f"a node finds its own crashed rank as here ({detect['source']}: "
         f"{detect['detail'].split(';')[0]})")
    decisions = DECISION_HOPS * nodes * round_trip_s
    teardown_here = here["teardown"]["value_s"]
    part("teardown", None if teardown_here is None else teardown_here + decisions, MODELLED,
         f"this node's teardown {fmt(teardown_here or 0)} (measured; every node at once) + the leader's decisions "
         f"{fmt(decisions)} = {DECISION_HOPS} hops, each woken by its key, of {nodes} nodes' reads served by the one "
         f"store at {round_trip_s * 1e6:.0f} µs a round trip (measured now on loopback; a lower bound)")
    part("verify", _verify(here["verify"], here_bytes, per_node), MODELLED if here["verify"].get("rule") != "manifest-and-sizes"
         else MEASURED, _verify_words(here["verify"], per_node))
    part("backoff", here["backoff"]["value_s"], CONFIGURED, f"the restart policy's, as here ({here['backoff']['detail']})")
    read_bw, per_thread = restore.get("read_bytes_per_s"), restore.get("hash_bytes_per_s_per_thread")
    read_s = per_node / read_bw if read_bw else None
    threads = min(cpus, gpus_per_node * HASH_THREADS)
    hash_s = per_node / (per_thread * threads) if per_thread else 0.0
    restore_s = None if read_s is None else max(read_s, hash_s)
    restart_here, restore_here = here["restart"]["value_s"], restore.get("restore_s") or 0.0
    rendezvous = 2 * ranks * round_trip_s + nodes * round_trip_s
    fixed = None if restart_here is None else max(0.0, restart_here - restore_here)
    part("restart", None if fixed is None or restore_s is None else fixed + restore_s + rendezvous, MODELLED,
         f"start-up and first step as here {fmt(fixed or 0)} (measured: restart {fmt(restart_here or 0)} less its restore "
         f"{fmt(restore_here)}) + restore of {per_node / 1e9:,.1f} GB per node {fmt(restore_s or 0)} (the slower of reading at "
         f"{(read_bw or 0) / 1e9:.2f} GB/s and hashing on {threads} threads at {(per_thread or 0) / 1e6:,.0f} MB/s each, both "
         f"measured here; a shared file system's aggregate bandwidth is not modelled) + process-group start-up "
         f"{fmt(rendezvous)} (≥ 2 store round trips per rank × {ranks} ranks + one per node, in series; NCCL set-up not modelled)")
    known = [p["value_s"] for p in parts.values()]
    rto = None if any(v is None for v in known) else sum(known)
    lost = here.get("lost_work", {})
    scale = per_rank / here_per_rank if here_per_rank else 1.0
    stall = (lost.get("stall_s") or 0.0) * scale
    persist = (lost.get("persist_s") or 0.0) * scale
    mtbf = mtbf_per_node_s / nodes if mtbf_per_node_s else None
    interval = daly(stall, mtbf) if mtbf and stall > 0 else None
    return {
        "nodes": nodes, "gpus_per_node": gpus_per_node, "ranks": ranks, "state_bytes": state_bytes,
        "bytes_per_node": per_node, "bytes_per_rank": per_rank, "store_round_trip_s": round_trip_s,
        "components": parts, "rto_s": rto,
        "save": {"stall_s": stall, "persist_s": persist, "mark": MODELLED,
                 "how": f"this run's stall and persist × {scale:,.3g} (bytes per rank {per_rank / 1e9:,.2f} GB against "
                        f"{here_per_rank / 1e9:,.4f} GB here)"},
        "mtbf_per_node_s": mtbf_per_node_s, "mtbf_s": mtbf,
        "daly_interval_s": interval,
        "goodput": goodput(interval, stall, persist, rto, mtbf) if interval is not None and rto is not None else None,
    }


def _verify(verify: dict[str, Any], here_bytes: int, per_node: float) -> float | None:
    value = verify.get("value_s")
    if value is None or verify.get("rule") == "manifest-and-sizes" or not here_bytes:
        return value
    return value * per_node / here_bytes


def _verify_words(verify: dict[str, Any], per_node: float) -> str:
    if verify.get("rule") == "manifest-and-sizes":
        return "manifest and sizes of the node's files, as here (their digests are checked as they load, in restore)"
    return f"whole-file digests of {per_node / 1e9:,.1f} GB per node at the rate measured on this snapshot"


def text_lines(projection: dict[str, Any]) -> list[str]:
    """The projection as the table ``estimate-rto`` prints below its own."""
    p = projection
    head = (f"projected to {p['nodes']} nodes × {p['gpus_per_node']} ranks, {p['state_bytes'] / 1e12:,.2f} TB of state "
            f"({p['bytes_per_node'] / 1e9:,.1f} GB per node):")
    rows = [("COMPONENT", "SECONDS", "MARK", "HOW")]
    rows += [(name, "?" if c["value_s"] is None else f"{c['value_s']:.3f}", c["mark"], c["how"])
             for name, c in p["components"].items()]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    out = ["", head] + [f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}" for r in rows]
    out.append(f"RTO {'?' if p['rto_s'] is None else format(p['rto_s'], '.1f')} s at that size; save stall "
               f"{p['save']['stall_s']:.3f} s ({p['save']['mark']})")
    if p["mtbf_s"]:
        out.append(f"MTBF {fmt(p['mtbf_s'])} ({fmt(p['mtbf_per_node_s'])} per node ÷ {p['nodes']}): Daly interval "
                   + ("unknown (no save cost recorded)" if p["daly_interval_s"] is None else
                      f"{fmt(p['daly_interval_s'])}, goodput " + ("?" if p["goodput"] is None else f"{p['goodput']:.4f}")))
    return out
