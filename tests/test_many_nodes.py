"""Many nodes end to end: two `ckptrun launch` processes on 127.0.0.1 ("node 0" leads, "node 1" joins), one
gloo rank each, one shared run dir. Each test kills both launchers' trees in a finalizer; timings are
recorded in events, never asserted. Cost: one uninterrupted reference run for the module (launched from a
faked Slurm environment: it is that test's run too), scenarios that start the same pair share one run, and
runs that never restart go without the warm standby (one torch import less per node)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Callable

import psutil
import pytest
from ports import free_port
from launch_helpers import CKPTRUN, Cleanup, assert_losses_equal, ckptrun, events, kill_tree, run_id, tail, wait_for

from ckptrun.runtime.records import final_losses, read_jsonl

pytestmark = pytest.mark.e2e
QUICK = ["--nproc-per-node", "1", "--heartbeat-timeout", "5", "--startup-timeout", "60", "--restart-backoff", "0.1",
         "--save-every-steps", "5", "--grace-period", "20"]
JOB = ["--", "--num-workers", "0", "--steps", "20"]
NO_RESTART = ["--no-standby"]  # a run that never restarts has no use for the next attempt's agent
# A test that kills something once a snapshot is out needs the job still running then: slow-save (sleeps in each save
# hook of the attempts named, never touches the losses) keeps the 15 steps that remain seconds long on any machine.
SLOW_ATTEMPT_1 = "slow-save:ms=300"
SLOW_ATTEMPTS_1_2 = f"{SLOW_ATTEMPT_1};slow-save:ms=300:attempt=2"


class Pair:
    """Two launchers of one job; logs per node under the test's directory."""

    def __init__(self, cwd: Path, cleanup: Cleanup, name: str, nnodes: str = "2") -> None:
        self.cwd, self.cleanup, self.name, self.nnodes = cwd, cleanup, name, nnodes
        self.port = free_port()
        self.run_dir = cleanup.run_dir(cwd / "runs" / name)
        self.procs: dict[int, subprocess.Popen] = {}

    def flags(self, node: int) -> list[str]:
        return ["--nnodes", self.nnodes, "--node-rank", str(node), "--rdzv-endpoint", f"127.0.0.1:{self.port}",
                "--name", self.name]

    def start(self, node: int, *args: str, env: dict[str, str] | None = None, command: str = "launch") -> subprocess.Popen:
        log = open(self.cwd / f"{self.name}-node{node}-{len(self.procs)}.log", "wb")
        popen = subprocess.Popen([*CKPTRUN, command, *args], cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT,
                                 env={**os.environ, **(env or {})})
        self.procs[node] = self.cleanup.track(popen)
        popen.log_path = Path(log.name)  # type: ignore[attr-defined]
        return popen

    def launch(self, *extra: str, job: list[str] = JOB) -> None:
        for node in (0, 1):
            self.start(node, *self.flags(node), *QUICK, *extra, *job)

    def wait(self, node: int, timeout: float = 200) -> int:
        popen = self.procs[node]
        try:
            return popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"node {node} did not exit:\n{tail(popen.log_path)}") from None  # type: ignore[attr-defined]

    def log(self, node: int) -> str:
        """The end of the node's launcher output: for a failure message."""
        return tail(self.procs[node].log_path, 4000)  # type: ignore[attr-defined]

    def whole_log(self, node: int) -> str:
        """All of the node's launcher output: what an assertion on a line searches (rank tracebacks after the
        line can push it out of any tail)."""
        return self.procs[node].log_path.read_text(errors="replace")  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def slurm_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted two-node run whose launchers learn their places from a faked Slurm environment alone
    (no node flag): its run dir. Its losses are the reference every flag-launched recovered run repeats
    bitwise, so each of those tests also shows that Slurm's job is the flags' job."""
    cwd = tmp_path_factory.mktemp("reference")
    tracker = Cleanup()
    try:
        pair = Pair(cwd, tracker, "slurm-4242")
        for node in (0, 1):
            slurm = {"SLURM_NNODES": "2", "SLURM_NODEID": str(node), "SLURM_JOB_NODELIST": "127.0.0.1",
                     "SLURM_JOB_ID": "4242", "MASTER_PORT": str(pair.port)}
            pair.start(node, *QUICK, *NO_RESTART, *JOB, env=slurm)
        codes = pair.wait(0), pair.wait(1)
        assert codes == (0, 0), f"{codes}\n{pair.log(0)}\n{pair.log(1)}"
        return pair.run_dir
    finally:
        tracker.close()


@pytest.fixture(scope="module")
def reference(slurm_run: Path) -> dict[int, float]:
    """The uninterrupted two-node run's losses: what every recovered run must repeat bitwise."""
    return final_losses(slurm_run)


@pytest.mark.timeout(360)
def test_the_memory_tier_on_two_nodes_restarts_each_node_from_its_own_memory_copy_exactly(
        tmp_path: Path, cleanup: Cleanup, reference: dict[int, float]) -> None:
    """Issue 25 item 1: a memory snapshot every 2 steps, durable every 20, each node its own --memory-dir (its
    "RAM"). Node 1's rank SIGKILLed after step 17: every node tells the leader its usable memory steps, the
    leader takes the newest step both hold (16, or 14 when step 16's background write had not finished on a node
    when the kill came: a memory save waits for the one before it, so 14 is always there), newer than any durable
    one; each node resumes from its own copy of its ranks' shards (restore_source tier memory on node 0 and
    node 1, durable_bytes_read 0), and the losses equal the uninterrupted two-node run bitwise. Before: refused
    with more than one node."""
    pair = Pair(tmp_path, cleanup, "memory-nodes")
    dirs = {node: tmp_path / f"ram-node{node}" for node in (0, 1)}
    for node in (0, 1):
        pair.start(node, *pair.flags(node), *QUICK, "--save-every-steps", "20", "--memory-every-steps", "2",
                   "--memory-dir", str(dirs[node]), "--local-addr", f"127.0.0.{node + 1}",  # nodes keep their ranks
                   "--inject-fault", "kill:rank=1:step=17", *JOB)
    codes = pair.wait(0), pair.wait(1)
    assert codes == (0, 0), f"{codes}\n{pair.log(0)}\n{pair.log(1)}"
    saved = events(pair.run_dir, "memory_saved")
    assert {(e["node"], Path(e["path"]).parent) for e in saved if e["step"] == 14} == {(0, dirs[0]), (1, dirs[1])}
    sources = events(pair.run_dir, "restore_source")
    step = sources[0]["step"]
    assert step in (14, 16) and all(step in {e["step"] for e in saved if e["node"] == n and e["attempt"] == 1}
                                    for n in (0, 1)), (sources, saved)
    assert sorted((e["node"], e["tier"], e["step"], e["durable_bytes_read"]) for e in sources) == \
        [(0, "memory", step, 0), (1, "memory", step, 0)], sources
    assert {Path(e["snapshot"]).parent for e in sources} == {dirs[0], dirs[1]}
    assert [(e["step"], e["tier"]) for e in events(pair.run_dir, "restored")] == [(step, "memory")]
    assert_losses_equal(pair.run_dir, reference)
    assert not dirs[0].exists() and not dirs[1].exists(), "each launch deletes its memory directory"


# --width 256: each rank's shard of the first layer (4 KiB) is smaller than the whole tensor once serialised (the
# whole 8 KiB): a node's memory copy that holds only its shards must load as such (a size check once took the
# global shape for what the node stores, and only tensors smaller than DCP's per-item overhead passed)
FSDP_JOB = [str(Path(__file__).parent / "fixtures" / "fsdp_job.py"), "--steps", "20", "--width", "256"]
# The FSDP2 tests run a real node's shape: two ranks on each node (ranks 0, 1 on node 0; 2, 3 on node 1), so that
# a node's own snapshot holds a part of every tensor from more than one rank (issue 38: with one rank per node,
# every memory save of two ranks per node failing went unseen). Node 1's last rank is the one the faults hit.
PER_NODE = ["--nproc-per-node", "2"]
NODE_1_RANK = 3


@pytest.fixture(scope="module")
def fsdp_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """An uninterrupted two-node FSDP2 run's losses (each node holds other shards of every parameter and of
    AdamW's moments): what every recovered FSDP2 run of this module repeats bitwise."""
    cwd = tmp_path_factory.mktemp("fsdp-reference")
    tracker = Cleanup()
    try:
        reference = Pair(cwd, tracker, "fsdp-reference")
        for node in (0, 1):
            reference.start(node, *reference.flags(node), *QUICK, *PER_NODE, *NO_RESTART, *FSDP_JOB)
        assert (reference.wait(0), reference.wait(1)) == (0, 0), f"{reference.log(0)}\n{reference.log(1)}"
        want = final_losses(reference.run_dir)
        assert sorted(want) == list(range(1, 21))
        return want
    finally:
        tracker.close()


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory):
    """A real S3 endpoint (moto_server on loopback) whose client environment the launchers inherit."""
    from s3_server import serving

    with serving(tmp_path_factory.mktemp("moto") / "moto.log") as server:
        yield server


@pytest.mark.timeout(420)
def test_each_nodes_local_cache_keeps_its_own_files_and_a_restart_reads_them_there_exactly(
        tmp_path: Path, cleanup: Cleanup, s3, fsdp_reference: dict[int, float]) -> None:
    """Issue 25 item 4: FSDP2 on two nodes, snapshots in S3 every 5 steps (synchronous: step 15 is committed
    before step 16 runs), each node its own --local-cache and --node-group, and the memory tier every 3 steps
    (accepted with the cache on many nodes; replicas go to the other rack). Each node's cache holds only its own ranks' files of each snapshot, with the
    whole manifest. Node 1's last rank is killed after step 17: no memory step is newer than the durable step 15,
    so every node restores step 15 from its own cache and downloads only the files it lacks (restore_source
    tier local-cache, 0 < durable_bytes_read < the snapshot's bytes), and the losses equal the uninterrupted
    two-node run bitwise."""
    pair = Pair(tmp_path, cleanup, "node-cache")
    url = f"s3://{s3.new_bucket()}/ckpt"
    caches = {node: tmp_path / f"disk-node{node}" for node in (0, 1)}
    for node in (0, 1):
        pair.start(node, *pair.flags(node), *QUICK, *PER_NODE, "--ckpt-dir", url, "--local-cache", str(caches[node]),
                   "--sync-save", "--memory-every-steps", "3", "--memory-dir", str(tmp_path / f"ram-node{node}"),
                   "--local-addr", f"127.0.0.{node + 1}", "--node-group", f"rack-{'ab'[node]}",
                   "--inject-fault", f"kill:rank={NODE_1_RANK}:step=17", *FSDP_JOB)
    assert (pair.wait(0), pair.wait(1)) == (0, 0), f"{pair.log(0)}\n{pair.log(1)}"
    received = events(pair.run_dir, "replica_received")  # each node's memory snapshots, on the node of the other rack
    assert {(e["node"], e["from_node"]) for e in received} == {(0, 1), (1, 0)}, received
    for node, cache in caches.items():
        copies = sorted(cache.glob("step-*"))
        assert [c.name for c in copies] == ["step-000000010", "step-000000015", "step-000000020"], (node, copies)
        for copy in copies:
            files = json.loads((copy / "manifest.json").read_text())["files"]
            held = {str(p.relative_to(copy)) for p in copy.rglob("*") if p.is_file()} - {"manifest.json"}
            restored = copy.name == "step-000000015"  # filled with the files it lacked, to be loaded
            assert held == {f["path"] for f in files if restored or (f.get("rank") or 0) // 2 == node}, (node, copy, held)
    sources = events(pair.run_dir, "restore_source")
    assert sorted((e["node"], e["tier"], e["step"]) for e in sources) == [(0, "local-cache", 15), (1, "local-cache", 15)], sources
    assert all(0 < e["durable_bytes_read"] < e["bytes"] for e in sources), sources
    assert {Path(e["snapshot"]).parent for e in sources} == {caches[0], caches[1]}
    assert_losses_equal(pair.run_dir, fsdp_reference)


@pytest.mark.timeout(300)
def test_with_node_groups_each_nodes_memory_replica_goes_to_another_rack(tmp_path: Path, cleanup: Cleanup) -> None:
    """Issue 25 item 2: three nodes, racks A (nodes 0, 1) and B (node 2), one replica each. The plain ring would
    keep node 0's replica in rack A (on node 1); with --node-group every replica that can leave its rack does:
    node 0's goes to node 2, node 2's to node 1, and node 1's (rack B holds one node) to node 0."""
    pair = Pair(tmp_path, cleanup, "racks", nnodes="3")
    for node, rack in enumerate("AAB"):
        pair.start(node, *_memory_flags(pair, node, tmp_path, *NO_RESTART, "--node-group", f"rack-{rack}", per_node=[]),
                   *FSDP_JOB)
    codes = [pair.wait(node) for node in range(3)]
    assert codes == [0, 0, 0], f"{codes}\n{pair.log(0)}\n{pair.log(2)}"
    received = events(pair.run_dir, "replica_received")
    assert {(e["node"], e["from_node"]) for e in received} == {(2, 0), (1, 2), (0, 1)}, received
    assert all(e["verified"] for e in received)


def _memory_flags(pair: Pair, node: int, root: Path, *extra: str, per_node: list[str] = PER_NODE) -> list[str]:
    """A node of a memory-tier job: its own --memory-dir (its "RAM") and address (each node keeps its ranks)."""
    return [*pair.flags(node), *QUICK, *per_node, "--memory-every-steps", "2", "--memory-dir",
            str(root / f"ram-node{node}"), "--local-addr", f"127.0.0.{node + 1}", *extra]


@pytest.mark.timeout(420)
def test_fsdp2_on_two_nodes_restores_each_nodes_own_shards_from_its_memory_exactly(
        tmp_path: Path, cleanup: Cleanup, fsdp_reference: dict[int, float]) -> None:
    """The same with FSDP2: node 1's rank killed after step 17, both nodes restore their own shards of the newest
    step both hold (16, or 14 as above) from their own memory, and the losses equal an uninterrupted two-node
    FSDP2 run's bitwise. Meanwhile each node's memory snapshots were replicated to the other, verified on receipt."""
    pair = Pair(tmp_path, cleanup, "fsdp-memory")
    for node in (0, 1):
        pair.start(node, *_memory_flags(pair, node, tmp_path, "--save-every-steps", "20",
                                        "--inject-fault", f"kill:rank={NODE_1_RANK}:step=17"), *FSDP_JOB)
    assert (pair.wait(0), pair.wait(1)) == (0, 0), f"{pair.log(0)}\n{pair.log(1)}"
    sources = events(pair.run_dir, "restore_source")
    step = sources[0]["step"]
    assert step in (14, 16) and sorted((e["node"], e["tier"], e["step"]) for e in sources) == \
        [(0, "memory", step), (1, "memory", step)], sources
    assert [(e["attempt"], e["step"], e["tier"]) for e in events(pair.run_dir, "restored")] == [(2, step, "memory")]
    assert_losses_equal(pair.run_dir, fsdp_reference)
    received = events(pair.run_dir, "replica_received")
    assert {(e["node"], e["from_node"]) for e in received} == {(0, 1), (1, 0)}, received
    assert all(e["verified"] and e["bytes"] > 0 and e["step"] % 2 == 0 for e in received), received
    assert not events(pair.run_dir, "replica_rejected")


def _lose_node_1(pair: Pair, tmp_path: Path, extra: list[str], join_timeout: str = "120",
                 before_kill: Callable[[], None] = lambda: None) -> None:
    """Rank 1 hangs after step 17 of attempt 1 (its heartbeat timeout is far off); once node 0 holds a verified
    replica of node 1's step 16, node 1's launcher and every process under it are SIGKILLed and its memory dir
    deleted (the node and its RAM are gone; a surviving rank's replica receiver would write into it again)."""
    fault = f"hang:rank={NODE_1_RANK}:step=17:attempt=1"
    for node in (0, 1):
        pair.start(node, *_memory_flags(pair, node, tmp_path, *extra, "--heartbeat-timeout", "60",
                                        "--node-join-timeout", join_timeout, "--inject-fault", fault), *FSDP_JOB)
    wait_for(lambda: any(e["node"] == 0 and e["from_node"] == 1 and e["step"] == 16
                         for e in events(pair.run_dir, "replica_received")), timeout=150, what="node 1's step 16 on node 0")
    before_kill()
    kill_tree(pair.procs[1].pid)  # the node and every process on it: none may write into its memory dir after this
    pair.procs[1].wait()
    shutil.rmtree(tmp_path / "ram-node1")


@pytest.mark.timeout(420)
def test_a_lost_node_restores_its_fsdp2_shards_from_a_replica_in_the_other_nodes_memory_exactly(
        tmp_path: Path, cleanup: Cleanup, fsdp_reference: dict[int, float]) -> None:
    """Issue 25 item 3: memory tier every 2 steps, one replica (the default with two nodes), durable every 20.
    Node 1 is lost after step 17 with its memory; the relaunched node 1 fetches its shards of step 16 from node
    0's replica, verifying every chunk as it arrives (tier peer-memory, the peer, the bytes moved, no durable
    byte read), node 0 restores its own copy, and the losses equal the uninterrupted two-node run bitwise."""
    pair = Pair(tmp_path, cleanup, "peer-memory")
    flags = ["--save-every-steps", "20"]
    _lose_node_1(pair, tmp_path, flags)
    pair.start(1, *_memory_flags(pair, 1, tmp_path, *flags, "--heartbeat-timeout", "60"), *FSDP_JOB)
    assert (pair.wait(0), pair.wait(1)) == (0, 0), f"{pair.log(0)}\n{pair.log(1)}"
    sources = events(pair.run_dir, "restore_source")
    assert sorted((e["node"], e["tier"], e["step"], e["durable_bytes_read"], e.get("peer")) for e in sources) == \
        [(0, "memory", 16, 0, None), (1, "peer-memory", 16, 0, 0)], sources
    fetched = events(pair.run_dir, "peer_fetched")
    assert [(e["node"], e["peer"], e["step"], e["verified"]) for e in fetched] == [(1, 0, 16, True)], fetched
    assert fetched[0]["bytes_moved"] == [e for e in sources if e["node"] == 1][0]["bytes_moved"] > 0
    assert [(e["attempt"], e["step"], e["tier"]) for e in events(pair.run_dir, "restored")] == [(2, 16, "memory")]
    assert_losses_equal(pair.run_dir, fsdp_reference)


@pytest.mark.timeout(420)
def test_a_hot_spare_takes_the_lost_nodes_place_at_once_and_restores_its_shards_from_memory_exactly(
        tmp_path: Path, cleanup: Cleanup, fsdp_reference: dict[int, float]) -> None:
    """Issue 25 item 5: a third launcher joins the job with --spare (no rank; `ckptrun status` lists it). Node 1
    is lost after step 17 with its memory; the leader promotes the spare to node rank 1 at once (spare_promoted;
    no wait for node 1's launcher, whose join timeout is 300 s), the spare's ranks fetch node 1's shards of step
    16 from node 0's replica (peer-memory, nothing durable read), and the losses equal the uninterrupted run's."""
    pair = Pair(tmp_path, cleanup, "spare")
    flags = ["--save-every-steps", "20"]
    spare_flags = ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{pair.port}", "--name", pair.name, *QUICK,
                   *PER_NODE, "--memory-every-steps", "2", "--memory-dir", str(tmp_path / "ram-spare"),
                   "--local-addr", "127.0.0.3",
                   "--heartbeat-timeout", "60", *flags]
    spare = pair.start(2, "--spare", *spare_flags, *FSDP_JOB)

    def listed_as_spare() -> None:
        wait_for(lambda: (pair.run_dir / "spares" / "spare-1.json").exists(), timeout=60, what="the spare's join")
        status = json.loads(ckptrun("status", str(pair.run_dir), "--json", cwd=tmp_path).stdout)
        assert [(s["spare"], s["alive"]) for s in status["spares"]] == [(1, True)], status["spares"]

    _lose_node_1(pair, tmp_path, flags, join_timeout="300", before_kill=listed_as_spare)
    assert (pair.wait(0), spare.wait(timeout=200)) == (0, 0), f"{pair.log(0)}\n{tail(spare.log_path)}"
    promoted = events(pair.run_dir, "spare_promoted")
    assert [(e["spare"], e["node"], e["attempt"]) for e in promoted] == [(1, 1, 2)], promoted
    assert not events(pair.run_dir, "node_wait"), "the leader never waited for node 1's launcher"
    restart = events(pair.run_dir, "restart")[0]
    assert restart["node_join_s"] < 300 and restart["lost_nodes"] == [1], restart
    sources = events(pair.run_dir, "restore_source")
    assert sorted((e["node"], e["tier"], e["step"], e["durable_bytes_read"]) for e in sources) == \
        [(0, "memory", 16, 0), (1, "peer-memory", 16, 0)], sources
    assert Path([e for e in sources if e["node"] == 1][0]["snapshot"]).parent == tmp_path / "ram-spare"
    assert_losses_equal(pair.run_dir, fsdp_reference)
    assert "promoted to node rank 1" in spare.log_path.read_text()  # type: ignore[attr-defined]
    # its first attempt as node 1 went through the standby it kept warm while it waited
    assert (1, 2) in [(e["node"], e["attempt"]) for e in events(pair.run_dir, "standby_used")]
    assert "ckptrun standby: ready" in (pair.run_dir / "spares" / "standby.log").read_text()


@pytest.mark.timeout(480)
def test_a_flipped_byte_in_the_replica_is_caught_on_arrival_and_the_restart_after_is_durable_and_exact(
        tmp_path: Path, cleanup: Cleanup, fsdp_reference: dict[int, float]) -> None:
    """The same loss, with one byte of node 0's replica of node 1's shards flipped before node 1 comes back:
    the relaunched node 1 rejects it on arrival naming the chunk, node 0 drops that replica, and one restart
    later both nodes resume from the durable snapshot of step 10, bitwise equal to the uninterrupted run."""
    pair = Pair(tmp_path, cleanup, "peer-flip")
    flags = ["--save-every-steps", "10"]
    _lose_node_1(pair, tmp_path, flags)
    replica = tmp_path / "ram-node0" / "replicas" / "node1" / "step-000000016"
    data = next(p for p in sorted((replica / "dcp").glob("*.safetensors")) if p.stat().st_size > 100)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))
    pair.start(1, *_memory_flags(pair, 1, tmp_path, *flags, "--heartbeat-timeout", "60"), *FSDP_JOB)
    assert (pair.wait(0), pair.wait(1)) == (0, 0), f"{pair.log(0)}\n{pair.log(1)}"
    failed = events(pair.run_dir, "restore_failed")
    assert [e["attempt"] for e in failed] == [2] and "do not match their digest" in failed[0]["reason"], failed
    dropped = events(pair.run_dir, "replica_dropped")
    assert [(e["node"], e["of_node"], e["step"]) for e in dropped] == [(0, 1, 16)], dropped
    assert not events(pair.run_dir, "peer_fetched")
    sources = events(pair.run_dir, "restore_source")
    assert sorted((e["tier"], e["node"], e["step"]) for e in sources) == \
        [("disk", 0, 10), ("disk", 1, 10), ("memory", 0, 16), ("peer-memory", 1, 16)], sources
    assert [r["attempt"] for r in events(pair.run_dir, "restart")] == [2, 3]
    assert [(e["attempt"], e["step"], e["tier"]) for e in events(pair.run_dir, "restored")] == [(3, 10, "disk")]
    assert_losses_equal(pair.run_dir, fsdp_reference)


@pytest.mark.timeout(360)
def test_a_rank_then_the_torchrun_killed_on_node_1_restart_both_nodes_from_one_snapshot_exactly(
        tmp_path: Path, cleanup: Cleanup, reference: dict[int, float]) -> None:
    """Two incidents on node 1 in one run, each one restart of both nodes from one snapshot both verified: its
    rank SIGKILLed once attempt 1 has a snapshot, then its torchrun (attempt 2's agent, a used standby)
    SIGKILLed once attempt 2 has written one of its own. A budget of exactly two restarts: each incident costs
    one unit, however many nodes see it (a second unit would give up with exit 1). The give-up on many nodes,
    leader and follower, is tests/test_supervisor_nodes.py's."""
    pair = Pair(tmp_path, cleanup, "kill")
    pair.launch("--max-restarts", "2", "--inject-fault", SLOW_ATTEMPTS_1_2)
    wait_for(lambda: _snapshot_after(pair, 0), timeout=150, what="attempt 1's first snapshot")
    _rank_of(pair.procs[1]).kill()  # torch's rendezvous, not the node rank, decides which global rank it is
    restored = wait_for(lambda: _attempt_start(pair, 2), timeout=150, what="attempt 2")["snapshot_step"]
    wait_for(lambda: _snapshot_after(pair, restored), timeout=150, what="a snapshot of attempt 2")
    _agent_of(pair.procs[1]).kill()
    assert (pair.wait(0), pair.wait(1)) == (0, 0), f"{pair.log(0)}\n{pair.log(1)}"
    assert_losses_equal(pair.run_dir, reference)
    wait_for(lambda: not _run_processes(pair.run_dir), timeout=30, what="no orphans")
    starts = events(pair.run_dir, "attempt_start")
    assert [e["attempt"] for e in starts] == [1, 2, 3], starts  # the leader's record: one restart per incident
    assert not events(pair.run_dir, "gave_up") and "restart 2/2: attempt 3" in pair.whole_log(0)
    failures = events(pair.run_dir, "failure")
    assert [f["attempt"] for f in failures] == [1, 2], failures  # one incident, written once
    assert failures[0]["node"] == 1, failures  # where the rank died, not node 0's collateral connection error
    assert "attempt 1 failed: node 1, rank" in pair.whole_log(0), pair.log(0)  # node 0 prints the root cause too
    restarts = events(pair.run_dir, "restart")
    assert restored >= 5 and restarts[0]["snapshot_step"] == restored < restarts[1]["snapshot_step"], restarts
    assert all(r.get("nodes") == [0, 1] for r in restarts), "a restart's snapshot was not verified by both nodes"
    logs = pair.run_dir / "nodes"
    shared, node_1 = read_jsonl(pair.run_dir / "events.jsonl"), read_jsonl(logs / "node-1" / "events.jsonl")
    assert not [r for r in shared if r["event"] == "failure" and r.get("node") == 1], "node 1 appended to the shared file"
    assert [r for r in node_1 if r["event"] == "failure"] == [f for f in failures if f.get("node") == 1]
    assert all((logs / f"node-{n}" / "logs" / f"attempt-{a}").is_dir() for n in (0, 1) for a in (2, 3))
    rdzv = {p.name.split("_")[0] for node in (0, 1) for p in (logs / f"node-{node}" / "logs").glob("attempt-*/*_*")}
    assert rdzv == {"kill-a1", "kill-a2", "kill-a3"}, rdzv  # a fresh rendezvous id per attempt
    estimate = ckptrun("estimate-rto", str(pair.run_dir), "--json", cwd=tmp_path, timeout=200)
    document = json.loads(estimate.stdout)
    assert document["components"]["verify"]["nodes"] == 2 and document["node_loss"]["join"]["value_s"] == 300.0
    assert document["totals"]["rto_node_loss_s"] > document["totals"]["rto_s"]
    report = ckptrun("report", str(pair.run_dir), "-o", str(tmp_path / "kill.png"), cwd=tmp_path, timeout=200)
    assert report.returncode == 0 and (tmp_path / "kill.html").exists(), report.stderr


def _snapshot_after(pair: Pair, step: int) -> bool:
    return any(e.get("step", 0) > step for e in events(pair.run_dir, "snapshot_saved"))


def _attempt_start(pair: Pair, attempt: int) -> dict | None:
    """The leader's record of ``attempt``'s start (a restart's ``restart`` event comes later: the RTO ledger)."""
    return next((e for e in events(pair.run_dir, "attempt_start") if e["attempt"] == attempt), None)


@pytest.mark.timeout(300)
def test_a_node_without_the_leaders_checkpoint_dir_is_refused_and_a_stop_from_node_1_stops_both_with_one_snapshot(
        tmp_path: Path, cleanup: Cleanup) -> None:
    """One leader for two scenarios: a node 1 launcher whose checkpoint dir is not node 0's storage is refused
    (exit 2) before it joins; the right one joins the same leader, and a stop asked on node 1 stops both."""
    pair = Pair(tmp_path, cleanup, "stop")
    endless = ["--", "--num-workers", "0", "--steps", "100000"]
    pair.start(0, *pair.flags(0), *QUICK, *NO_RESTART, *endless)
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "runs").symlink_to(tmp_path / "runs")  # the run dir is shared, the checkpoint dir is not
    refused = subprocess.run([*CKPTRUN, "launch", *pair.flags(1), *QUICK, "--ckpt-dir", str(other / "ckpt"), *endless],
                             cwd=tmp_path, capture_output=True, text=True, timeout=100)
    assert refused.returncode == 2, refused.stderr
    assert "is not the storage node 0" in refused.stderr and "Traceback" not in refused.stderr
    pair.start(1, *pair.flags(1), *QUICK, *NO_RESTART, *endless)
    wait_for(lambda: len(final_losses(pair.run_dir)) >= 3, timeout=120, what="training on both nodes")
    status = json.loads(ckptrun("status", str(pair.run_dir), "--json", cwd=tmp_path).stdout)
    assert [n["node"] for n in status["nodes"]] == [0, 1] and all(n["alive"] for n in status["nodes"]), status
    assert sorted(r.get("node") for r in status["ranks"]) == [0, 1], status["ranks"]
    pair.procs[1].send_signal(signal.SIGTERM)
    assert (pair.wait(0), pair.wait(1)) == (3, 3), f"{pair.log(0)}\n{pair.log(1)}"
    stopped = events(pair.run_dir, "run_stopped")
    assert len(stopped) == 1 and stopped[0]["snapshot_step"] is not None, stopped


@pytest.mark.timeout(300)
def test_the_leader_killed_during_a_hang_makes_node_1_exit_requeue_leaves_no_orphan_and_both_resume_exactly(
        tmp_path: Path, cleanup: Cleanup, reference: dict[int, float]) -> None:
    """Every rank hangs after step 9 in attempt 1 and nothing detects it (a 600 s heartbeat timeout): the job
    waits there, so the leader is killed while the job cannot have finished. The killed launcher is left
    unreaped (a zombie, as under a parent that does not wait): its hung rank and its torchrun must go anyway.
    The resume is attempt 2, where the hang (attempt 1's only) does not fire."""
    pair = Pair(tmp_path, cleanup, "lead")
    pair.launch(*NO_RESTART, "--heartbeat-timeout", "600", "--inject-fault", "hang:step=9")
    wait_for(lambda: len(_rank_logs(pair, 1, "injected fault hang")) == 2, timeout=150, what="both ranks hung")
    leader = pair.procs[0]
    os.kill(leader.pid, signal.SIGKILL)  # never waited for: a zombie until the test's cleanup
    assert pair.wait(1, timeout=60) == 5, pair.log(1)
    wait_for(lambda: not _run_processes(pair.run_dir), timeout=30, what="no orphans")
    assert psutil.Process(leader.pid).status() == psutil.STATUS_ZOMBIE
    for node in (0, 1):
        pair.start(node, "--latest", "--run-dir", str(pair.run_dir), "--node-rank", str(node), command="resume")
    assert (pair.wait(0), pair.wait(1)) == (0, 0), f"{pair.log(0)}\n{pair.log(1)}"
    assert_losses_equal(pair.run_dir, reference)
    lost = events(pair.run_dir, "leader_lost")
    assert [e["node"] for e in lost] == [1], lost
    assert [e["attempt"] for e in events(pair.run_dir, "attempt_start")] == [1, 2]


def _rank_logs(pair: Pair, attempt: int, text: str) -> list[Path]:
    """The rank logs of ``attempt`` (both nodes) that contain ``text``."""
    logs = pair.run_dir.glob(f"nodes/node-*/logs/attempt-{attempt}/**/stderr.log")
    return [p for p in logs if text in p.read_text(errors="replace")]


@pytest.mark.timeout(240)
def test_a_faked_slurm_environment_launches_the_same_job(slurm_run: Path, reference: dict[int, float]) -> None:
    """The module's reference run: SLURM_* alone made it a two-node job named by SLURM_JOB_ID; that its losses
    are a flag-launched run's is asserted by every recovery test here (each repeats them bitwise)."""
    assert run_id(slurm_run) == "slurm-4242" and sorted(reference) == list(range(1, 21))
    launch = events(slurm_run, "launch")
    assert len(launch) == 1 and int(launch[0]["nnodes"]) == 2 and "--nnodes" not in launch[0]["argv"], launch
    placed = [json.loads((slurm_run / "nodes" / f"node-{n}" / "ranks.json").read_text())["ranks"] for n in (0, 1)]
    assert sorted(r for ranks in placed for r in ranks) == [0, 1], placed  # one rank on each node
    assert [e["attempt"] for e in events(slurm_run, "attempt_start")] == [1] and not events(slurm_run, "failure")


def _run_processes(run_dir: Path) -> list:
    from launch_helpers import run_processes

    return run_processes(run_dir)


def _agent_of(popen: subprocess.Popen) -> psutil.Process:
    """The launcher's running torchrun: its child with ranks under it (a fresh agent, or a standby given the
    attempt; a waiting standby has none). By the tree, not the command line: a forked rank has its agent's."""
    def find() -> psutil.Process | None:
        for child in psutil.Process(popen.pid).children():
            try:
                if child.status() != psutil.STATUS_ZOMBIE and child.children():
                    return child
            except psutil.Error:
                continue
        return None
    return wait_for(find, timeout=60, what="the attempt's torchrun")


def _rank_of(popen: subprocess.Popen) -> psutil.Process:
    """The (one) rank process under a launcher: its torchrun's child."""
    return wait_for(lambda: _agent_of(popen).children(), timeout=60, what="the rank under the launcher")[0]


@pytest.mark.timeout(360)
def test_node_1s_supervisor_killed_and_relaunched_rejoins_then_a_hang_is_detected_with_its_stack_dumped(
        tmp_path: Path, cleanup: Cleanup, reference: dict[int, float]) -> None:
    """Two incidents in one run. Attempt 1: node 1's launcher is SIGKILLed once a snapshot is out and relaunched
    within the join timeout (as a scheduler would); its ranks notice and leave, and node 1 joins attempt 2.
    Attempt 2: rank 1 hangs after step 18 (past any snapshot attempt 1 can have written of 20 steps): the hang
    is detected and a rank's stack dumped; attempt 3 completes."""
    faults = f"{SLOW_ATTEMPT_1};hang:rank=1:step=18:attempt=2"
    pair = Pair(tmp_path, cleanup, "rejoin")
    pair.launch("--node-join-timeout", "120", "--inject-fault", faults)
    wait_for(lambda: any(e.get("step", 0) >= 5 for e in events(pair.run_dir, "snapshot_saved")), timeout=150,
             what="the first snapshot")
    os.kill(pair.procs[1].pid, signal.SIGKILL)  # the launcher alone: its ranks must notice and leave
    pair.procs[1].wait()
    pair.start(1, *pair.flags(1), *QUICK, "--inject-fault", faults, *JOB)  # the scheduler relaunches it
    assert (pair.wait(0), pair.wait(1)) == (0, 0), f"{pair.log(0)}\n{pair.log(1)}"
    assert_losses_equal(pair.run_dir, reference)
    joined = events(pair.run_dir, "node_joined")
    assert [e["node"] for e in joined] == [1], joined
    assert [r["attempt"] for r in events(pair.run_dir, "restart")] == [2, 3]
    hangs = [f for f in events(pair.run_dir, "failure") if f["cause"] == "hang"]
    assert [f["attempt"] for f in hangs] == [2], events(pair.run_dir, "failure")
    dumps = [p for p in (pair.run_dir / "nodes").glob("node-*/logs/attempt-2/**/stderr.log")
             if "most recent call first" in p.read_text(errors="replace")]
    assert dumps, "no rank's stack was dumped"


def _join_count(pair: Pair, node: int) -> int:
    """How many launchers of node rank ``node`` have joined the job (its incarnation in the leader's store)."""
    from ckptrun.cli.supervision.job_store import JobStore, StoreUnreachable

    try:
        job = JobStore.connect(run_id(pair.run_dir), "127.0.0.1", pair.port + 1, timeout_s=5.0)  # the store: port + 1
        return int((job.node(node) or {}).get("incarnation", 0))
    except (StoreUnreachable, OSError, ValueError):
        return 0


@pytest.mark.timeout(420)
def test_elastic_two_nodes_to_one_continues_resharded_and_grows_back_with_the_sample_stream_intact(
        tmp_path: Path, cleanup: Cleanup) -> None:
    """2 nodes → 1 (node 1 lost past the join timeout) → 2 (node 1's launcher relaunched, joined at the next
    restart). Attempt 2 saves slowly (``slow-save``) so that it is still training when node 1 has joined."""
    steps = 40
    pair = Pair(tmp_path, cleanup, "elastic", nnodes="1:2")
    pair.launch("--allow-reshard", "--node-join-timeout", "5", "--inject-fault", "slow-save:ms=1000:attempt=2",
                job=["--", "--num-workers", "0", "--steps", str(steps)])
    wait_for(lambda: any(e.get("step", 0) >= 5 for e in events(pair.run_dir, "snapshot_saved")), timeout=150,
             what="the first snapshot")
    kill_tree(pair.procs[1].pid)  # node 1 is gone past the join timeout
    pair.procs[1].wait()
    from ckptrun.runtime.records import read_metrics

    wait_for(lambda: any(m.get("attempt") == 2 and m.get("step", 0) >= 8 for m in read_metrics(pair.run_dir)),
             timeout=150, what="a few steps on node 0 alone")
    pair.start(1, *pair.flags(1), *QUICK, "--allow-reshard", "--node-join-timeout", "5", "--inject-fault",
               "slow-save:ms=1000:attempt=2", "--", "--num-workers", "0", "--steps", str(steps))  # relaunched
    wait_for(lambda: _join_count(pair, 1) >= 2, timeout=150, what="node 1's relaunched launcher to join")
    shrunk_from = next(e["snapshot_step"] for e in events(pair.run_dir, "attempt_start") if e["attempt"] == 2)
    wait_for(lambda: any(e["step"] > shrunk_from for e in events(pair.run_dir, "snapshot_saved")), timeout=150,
             what="a snapshot written on node 0 alone")
    _rank_of(pair.procs[0]).kill()  # the second incident: the leader's next restart takes node 1 back
    assert (pair.wait(0), pair.wait(1)) == (0, 0), f"{pair.log(0)}\n{pair.log(1)}"
    wait_for(lambda: not _run_processes(pair.run_dir), timeout=30, what="no processes left")

    changed = [(e.get("lost"), e.get("joined"), e["nodes"]) for e in events(pair.run_dir, "nodes_changed")]
    assert changed == [([1], None, [0]), (None, [1], [0, 1])], changed
    shrink, grow = events(pair.run_dir, "restart")
    assert (shrink["nodes"], grow["nodes"]) == ([0], [0, 1]), (shrink, grow)
    resharded = [(e["old_world_size"], e["new_world_size"], e["step"]) for e in events(pair.run_dir, "resharded")]
    assert resharded == [(2, 1, shrink["snapshot_step"]), (1, 2, grow["snapshot_step"])], resharded
    assert grow["snapshot_step"] > shrink["snapshot_step"]  # a snapshot written on one node

    seen = {(m["attempt"], m["step"]): m["samples_seen"] for m in read_metrics(pair.run_dir) if "samples_seen" in m}
    for restart in (shrink, grow):  # the first step after each restart: the snapshot's count + the new global batch
        attempt, snap = restart["attempt"], restart["snapshot_step"]
        at_snapshot = seen[(max(a for a, s in seen if s == snap and a < attempt), snap)]
        first_after = min(s for a, s in seen if a == attempt)
        assert first_after == snap + 1
        assert seen[(attempt, first_after)] == at_snapshot + 32 * len(restart["nodes"]), (restart, seen)
    assert max(s for _, s in seen) == steps
    final = 64 * shrink["snapshot_step"] + 32 * (grow["snapshot_step"] - shrink["snapshot_step"]) + 64 * (
        steps - grow["snapshot_step"])
    assert seen[(grow["attempt"], steps)] == final  # no sample skipped or repeated across both reshards


def test_a_non_leader_node_keeps_its_own_store_credentials_over_run_json(tmp_path: Path) -> None:
    """Non-leader launchers run the leader's run.json, which never holds credentials: the node's own
    --storage-option secrets are merged back, so its ranks can upload (issue 24; before: lost, every upload failed)."""
    from ckptrun.cli import store_location
    from ckptrun.cli.supervision.many_nodes import with_own_secrets
    from ckptrun.cli.supervision.spec import RunRecord, build_spec, read_run_record, write_run_record

    own = build_spec(store_location.split_spec({"ckpt_dir": "s3://bucket/ckpt", "nnodes": "2",
                                                "store_options": ["key=AKIA-NODE-1", "secret=s3cr3t", "anon=false"]}))
    assert own.store_secrets == {"key": "AKIA-NODE-1", "secret": "s3cr3t"}
    write_run_record(tmp_path, RunRecord(run_id="nodes", spec=own))
    assert "s3cr3t" not in (tmp_path / "run.json").read_text()
    led = read_run_record(tmp_path)
    assert led.spec.store_secrets == {}, "run.json holds no secrets"
    options = json.loads(with_own_secrets(led, own).spec.worker_policy()["storage_options"])
    assert options["key"] == "AKIA-NODE-1" and options["secret"] == "s3cr3t" and options["anon"] in (False, "false")
