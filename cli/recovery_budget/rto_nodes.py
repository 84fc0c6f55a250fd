"""What a many-node run adds to the recovery estimate: the verify spread over the nodes, and a lost node's wait.

A restart's snapshot is verified by every node at once, each hashing a
disjoint share of its files, so the verify measured here on one machine is
divided by the node count (a run's own history, already cross-node, is kept
as measured). A lost node costs more than a crashed rank: its silence must
last the node timeout before the leader judges it lost, then the leader waits
for a relaunched launcher of that node rank (``--node-join-timeout`` bounds
it; past ``node_joined`` events say how long it really took) — or, when the
run keeps hot spares (``spare_joined`` events), promotes one at once, whose
first attempt goes through the warm standby the spare kept while it waited —
a restart like any other — or, with ``--no-standby``, a fresh agent. One node:
no change. Importable without torch.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from ckptrun.cli.durations import format_duration as fmt
from ckptrun.cli.recovery_budget.rto_components import Target, restore_estimate, setup_and_first_step
from ckptrun.cli.recovery_budget.rto_model import CONFIGURED, ESTIMATED, HISTORY, Component
from ckptrun.cli.supervision.spares import POLL_S as SPARE_POLL_S

NODE_TIMEOUT_CAP_S = 30.0  # the leader's node timeout: the heartbeat timeout, 5 s at least, 30 s at most


def node_count(target: Target) -> int:
    return int(target.spec.nnodes.split(":")[-1]) if target.spec is not None else 1


def ranks_per_node(target: Target, world: int) -> int:
    """One node's share of ``world`` ranks: what a no-op relaunch times (the nodes relaunch side by side)."""
    return max(1, world // node_count(target))


def spread_verify(target: Target, verify: Component) -> Component:
    """The verify a restart of this run makes: this machine's measurement shared by every node."""
    nodes = node_count(target)
    if nodes == 1 or verify.value_s is None:
        return verify
    return replace(verify, value_s=verify.value_s / nodes,
                   detail=f"{verify.detail}; spread over {nodes} nodes (each hashes 1/{nodes} of the files)",
                   facts={**verify.facts, "nodes": nodes, "one_node_s": verify.value_s})


def node_loss(target: Target, time_fresh_launch: Callable[[], float] | None = None) -> dict[str, Any] | None:
    """How long a lost node adds: its detection, the wait for its replacement, and (replaced by a spare) the
    spare's first attempt: past promotions' restarts; else, through the standby the spare keeps warm, the
    restart's own estimate (``restart`` None); without a standby ``time_fresh_launch()`` (a no-op relaunch
    through a fresh agent, measured now) + the restore + the script's set-up and first step."""
    if node_count(target) == 1 or target.spec is None:
        return None
    detect_s = max(5.0, min(target.spec.heartbeat_timeout, NODE_TIMEOUT_CAP_S))
    spares = [e for e in target.events if e.get("event") == "spare_joined"]
    promoted = sorted(float(e["joined_s"]) for e in target.events if e.get("event") == "spare_promoted" and "joined_s" in e)
    waits = sorted(float(e["waited_s"]) for e in target.events if e.get("event") == "node_joined" and "waited_s" in e)
    restart = None
    if spares or promoted:
        join = Component("node_join", promoted[len(promoted) // 2], HISTORY, f"a spare's promotion, median of "
                         f"{len(promoted)} past one(s)") if promoted else \
            Component("node_join", SPARE_POLL_S, CONFIGURED, f"a spare ({len(spares)} joined this run) takes the rank at "
                      f"once: it reads its promotion within one poll ({fmt(SPARE_POLL_S)}), modelled")
        after = [r for r in target.restarts if r.get("lost_nodes") and r.get("relaunch_to_first_step_s")]
        if promoted and after:
            value = sorted(float(r["relaunch_to_first_step_s"]) for r in after)[len(after) // 2]
            restart = Component("restart", value, HISTORY, f"median of {len(after)} restart(s) after a spare took "
                                "a lost node's rank").to_json()
        elif time_fresh_launch is not None and not target.spec.standby:
            launch = time_fresh_launch()
            restore, how, _ = restore_estimate(target, target.manifest.world_size)
            step, step_words = setup_and_first_step(target)
            restart = Component("restart", launch + restore + step, ESTIMATED, f"the spare's first attempt: a no-op "
                                f"relaunch through a fresh torchrun agent {fmt(launch)} (measured) + {how} + "
                                f"{step_words}").to_json()
    elif waits:
        join = Component("node_join", waits[len(waits) // 2], HISTORY, f"median of {len(waits)} past rejoin(s)")
    else:
        join = Component("node_join", target.spec.node_join_timeout, CONFIGURED,
                         f"--node-join-timeout {fmt(target.spec.node_join_timeout)} (run.json) as a bound")
    return {"detect_s": detect_s, "join": join.to_json(), "restart": restart}
