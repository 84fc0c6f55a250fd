"""A list of node ranks as the job's store carries it: ranges, not numbers ("0-1023").

Every follower reads the attempt's nodes in each word of the leader (and the verify round's, and sends its
own with its share's verdict); 1,024 nodes as a JSON list in each of 1,024 reads is a million numbers to
encode and decode per restart, most of a simulated 1,024-node restart's CPU.
"""

from __future__ import annotations

from typing import Any, Iterable


def pack_nodes(nodes: Iterable[int]) -> str:
    """A node list as ranges ("0-1023", "0-4,6-9")."""
    ordered = sorted(set(nodes))
    if ordered and ordered[-1] - ordered[0] == len(ordered) - 1:  # one range (every node, in order)
        return f"{ordered[0]}-{ordered[-1]}" if len(ordered) > 1 else str(ordered[0])
    ranges: list[list[int]] = []
    for node in ordered:
        if ranges and node == ranges[-1][1] + 1:
            ranges[-1][1] = node
        else:
            ranges.append([node, node])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in ranges)


def unpack_nodes(packed: str | list[int]) -> list[int]:
    """The nodes of :func:`pack_nodes` (a list is taken as it is)."""
    if isinstance(packed, list):
        return [int(n) for n in packed]
    nodes: list[int] = []
    for part in filter(None, packed.split(",")):
        first, _, last = part.partition("-")
        nodes.extend(range(int(first), int(last or first) + 1))
    return nodes


def nodes_listed(record: dict[str, Any] | None) -> dict[str, Any] | None:
    """A record of the store (an attempt, a verify round) with its ``nodes`` as a list again."""
    return None if record is None else {**record, "nodes": unpack_nodes(record["nodes"])}
