"""What a many-node run adds to the recovery estimate: the verify spread over the nodes, and a lost node's wait.

A restart's snapshot is verified by every node at once, each hashing a
disjoint share of its files, so the verify measured here on one machine is
divided by the node count (a run's own history, already cross-node, is kept
as measured). A lost node costs more than a crashed rank: its silence must
last the node timeout before the leader judges it lost, then the leader waits
for a relaunched launcher of that node rank (``--node-join-timeout`` bounds
it; past ``node_joined`` events say how long it really took). One node: no
change. Importable without torch.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ckptrun.cli.durations import format_duration as fmt
from ckptrun.cli.recovery_budget.rto_components import Target
from ckptrun.cli.recovery_budget.rto_model import CONFIGURED, HISTORY, Component

NODE_TIMEOUT_CAP_S = 30.0  # the leader's node timeout: the heartbeat timeout, 5 s at least, 30 s at most


def node_count(target: Target) -> int:
    return int(target.spec.nnodes.split(":")[-1]) if target.spec is not None else 1


def spread_verify(target: Target, verify: Component) -> Component:
    """The verify a restart of this run makes: this machine's measurement shared by every node."""
    nodes = node_count(target)
    if nodes == 1 or verify.value_s is None:
        return verify
    return replace(verify, value_s=verify.value_s / nodes,
                   detail=f"{verify.detail}; spread over {nodes} nodes (each hashes 1/{nodes} of the files)",
                   facts={**verify.facts, "nodes": nodes, "one_node_s": verify.value_s})


def node_loss(target: Target) -> dict[str, Any] | None:
    """How long a lost node adds before the relaunch: its detection and the wait for its launcher to rejoin."""
    if node_count(target) == 1 or target.spec is None:
        return None
    detect_s = max(5.0, min(target.spec.heartbeat_timeout, NODE_TIMEOUT_CAP_S))
    waits = sorted(float(e["waited_s"]) for e in target.events if e.get("event") == "node_joined" and "waited_s" in e)
    if waits:
        join = Component("node_join", waits[len(waits) // 2], HISTORY, f"median of {len(waits)} past rejoin(s)")
    else:
        join = Component("node_join", target.spec.node_join_timeout, CONFIGURED,
                         f"--node-join-timeout {fmt(target.spec.node_join_timeout)} (run.json) as a bound")
    return {"detect_s": detect_s, "join": join.to_json()}
