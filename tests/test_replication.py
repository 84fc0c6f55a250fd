"""Memory replicas on other nodes (issue 25 items 2-3), the parts below a launch: the transport between two
real gloo processes (every chunk verified on receipt, a flipped byte rejected and named), the ring, and the
leader's choice of the newest step whose every node's shards are in memory somewhere. The launches that use
them (replication during training, a lost node restored from a replica) are in test_many_nodes.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from snapshot_factory import make_chunked_snapshot
from ports import free_port

from ckptrun.cli.supervision.node_world import newest_in_memory
from ckptrun.runtime.checkpoint.replication import PIECE, Ring
from ckptrun.runtime.manifest import MANIFEST_NAME, read_manifest

PAIR = Path(__file__).parent / "fixtures" / "replication_pair.py"


def _chunked(ckpt_dir: Path, step: int, size: int, chunk: int) -> Path:
    """A snapshot whose data file (several transport pieces long) has a digest per ``chunk`` bytes."""
    return make_chunked_snapshot(ckpt_dir, step, chunk=chunk, data=os.urandom(size))


def _pair(snapshots: list[Path], into: Path, report: Path) -> tuple[list, list]:
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": "2"}
        procs.append(subprocess.Popen([sys.executable, str(PAIR), *map(str, snapshots), "--into", str(into),
                                       "--report", str(report)], env=env, stderr=subprocess.PIPE, text=True))
    try:
        errors = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], errors
    return json.loads(report.read_text()), json.loads(report.with_suffix(".acks").read_text())


@pytest.mark.timeout(180)
def test_a_replica_arrives_byte_for_byte_and_a_flipped_byte_is_rejected_naming_its_chunk(tmp_path: Path) -> None:
    """Two snapshots sent over gloo: the good one (its data file 2.5 transport pieces, 4 MiB chunks) is published
    in the receiver's directory equal byte for byte, with the sender's manifest; the one with a byte flipped after
    its manifest was written is rejected on receipt, naming the chunk, nothing published, and the sender told."""
    size = int(PIECE * 2.5)
    good = _chunked(tmp_path / "a", 4, size, 4 * 2**20)
    bad = _chunked(tmp_path / "b", 6, size, 4 * 2**20)
    data = bad / "dcp" / "__0_0.safetensors"
    flipped = bytearray(data.read_bytes())
    flipped[PIECE + 12345] ^= 0x01
    data.write_bytes(bytes(flipped))
    got, acks = _pair([good, bad], tmp_path / "replicas", tmp_path / "report.json")
    assert acks == [True, False]
    assert got[-1] is None and len(got) == 3
    first, second = got[0], got[1]
    assert (first["step"], first["problem"]) == (4, None) and first["bytes"] >= size
    replica = Path(first["path"])
    assert replica == tmp_path / "replicas" / "step-000000004"
    for entry in read_manifest(good).files:
        assert (replica / entry.path).read_bytes() == (good / entry.path).read_bytes(), entry.path
    assert (replica / MANIFEST_NAME).read_bytes() == (good / MANIFEST_NAME).read_bytes()
    start = (PIECE + 12345) // (4 * 2**20) * 4 * 2**20
    assert second["path"] is None and second["step"] == 6
    assert f"dcp/__0_0.safetensors: bytes {start}..{start + 4 * 2**20}" in second["problem"], second
    assert sorted(p.name for p in (tmp_path / "replicas").iterdir()) == ["step-000000004"], "nothing else is left"


def test_the_ring_sends_each_node_to_the_next_r_nodes_and_its_leads_are_each_nodes_first_rank() -> None:
    ring = Ring.of([0, 0, 1, 1, 2, 2], 1)
    assert ring.leads == (0, 2, 4)
    assert [ring.targets(n) for n in range(3)] == [[1], [2], [0]]
    assert [ring.sources(n) for n in range(3)] == [[2], [0], [1]]
    assert Ring.of([0, 1], 5).replicas == 1, "never more replicas than other nodes"
    assert [Ring.of([0, 1, 2, 3], 2).targets(n) for n in (0, 3)] == [[1, 2], [0, 1]]


def test_with_node_groups_replicas_leave_their_failure_domain_and_every_node_holds_as_many() -> None:
    """Issue 25 item 2: --node-group names each node's failure domain (one entry per rank, as gathered). Racks
    A = nodes 0, 1 and B = nodes 2, 3: the plain ring would send node 0's replica to node 1 in its own rack; the
    ring interleaved by group sends every node's to the other rack, and each node still receives one."""
    groups = ["A", "A", "A", "A", "B", "B", "B", "B"]  # two ranks per node
    ring = Ring.of([0, 0, 1, 1, 2, 2, 3, 3], 1, groups)
    assert [ring.targets(n) for n in range(4)] == [[2], [3], [1], [0]]
    assert all(groups[ring.leads[t]] != groups[ring.leads[n]] for n in range(4) for t in ring.targets(n))
    assert sorted(t for n in range(4) for t in ring.targets(n)) == [0, 1, 2, 3], "one replica held per node"
    assert all(n in ring.targets(s) for n in range(4) for s in ring.sources(n)), "sources are the senders"
    # a group of three and a lone node: what cannot leave the domain stays in it, still one replica each
    uneven = Ring.of([0, 1, 2, 3], 1, ["A", "A", "A", "B"])
    assert sorted(t for n in range(4) for t in uneven.targets(n)) == [0, 1, 2, 3]
    assert uneven.targets(3) != [] and uneven.targets(3)[0] in (0, 1, 2) and uneven.targets(0) == [3]
    assert Ring.of([0, 1, 2], 1, [None, None, None]).targets(0) == [1], "no groups: the plain ring"


def test_the_restart_takes_the_newest_step_whose_every_shard_is_in_memory_somewhere() -> None:
    """Node 1 was lost (it holds nothing now): step 16 exists only as node 0's own copy, step 14 as node 0's copy
    and node 0's replica of node 1: 14 wins, node 1 fetching from node 0. With node 1's own copies, 16 wins with no
    fetch; with neither, nothing in memory above the durable step."""
    replicas = {0: {1: {12: 100, 14: 100}}, 1: {}}
    assert newest_in_memory({0: [16, 14], 1: []}, replicas, 10) == (14, {1: {"from": 0, "bytes": 100}})
    assert newest_in_memory({0: [16, 14], 1: [16, 14]}, replicas, 10) == (16, {})
    assert newest_in_memory({0: [16, 14], 1: []}, {0: {}, 1: {}}, 10) == (None, {})
    assert newest_in_memory({0: [16, 14], 1: []}, replicas, 14) == (None, {}), "never at or below the durable step"
    three = {0: [8], 1: [8], 2: []}
    assert newest_in_memory(three, {0: {}, 1: {2: {8: 5}}, 2: {}}, 0) == (8, {2: {"from": 1, "bytes": 5}})
