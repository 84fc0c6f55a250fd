"""Many nodes end to end: two `ckptrun launch` processes on 127.0.0.1 ("node 0" leads, "node 1" joins), one
gloo rank each, one shared run dir. Each test kills both launchers' trees in a finalizer; timings are
recorded in events, never asserted."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import psutil
import pytest
from launch_helpers import CKPTRUN, Cleanup, assert_losses_equal, ckptrun, events, kill_tree, run_id, tail, wait_for

from ckptrun.runtime.records import final_losses

pytestmark = pytest.mark.e2e
QUICK = ["--nproc-per-node", "1", "--heartbeat-timeout", "5", "--startup-timeout", "60", "--restart-backoff", "0.1",
         "--save-every-steps", "5", "--grace-period", "20"]
JOB = ["--", "--num-workers", "0", "--steps", "20"]


def free_port() -> int:
    """A free port whose next one is free too (the job's store takes rendezvous port + 1), below the kernel's
    ephemeral range: node 0's torchrun binds the rendezvous port only at each attempt, and an outgoing
    connection of any other process could take an ephemeral port meanwhile (as 29500 is, on a cluster)."""
    while True:
        port = random.randrange(20000, 32000)
        try:
            with socket.socket() as probe, socket.socket() as other:
                probe.bind(("127.0.0.1", port))
                other.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue


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
        return tail(self.procs[node].log_path, 4000)  # type: ignore[attr-defined]


@pytest.fixture
def cleanup() -> Iterator[Cleanup]:
    tracker = Cleanup()
    yield tracker
    tracker.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """An uninterrupted two-node run: the losses every recovered run must repeat bitwise."""
    cwd = tmp_path_factory.mktemp("reference")
    tracker = Cleanup()
    try:
        pair = Pair(cwd, tracker, "ref")
        pair.launch()
        codes = pair.wait(0), pair.wait(1)
        assert codes == (0, 0), f"{codes}\n{pair.log(0)}\n{pair.log(1)}"
        return final_losses(pair.run_dir)
    finally:
        tracker.close()


@pytest.mark.timeout(300)
def test_a_rank_killed_on_node_1_restarts_both_nodes_from_one_snapshot_exactly(tmp_path: Path, cleanup: Cleanup,
                                                                               reference: dict[int, float]) -> None:
    pair = Pair(tmp_path, cleanup, "kill")
    pair.launch()
    wait_for(lambda: any(e.get("step", 0) >= 10 for e in events(pair.run_dir, "snapshot_saved")), timeout=150,
             what="the step-10 snapshot")
    victim = _rank_of(pair.procs[1])  # torch's rendezvous, not the node rank, decides which global rank it is
    victim.kill()
    assert (pair.wait(0), pair.wait(1)) == (0, 0), f"{pair.log(0)}\n{pair.log(1)}"
    assert_losses_equal(pair.run_dir, reference)
    starts = events(pair.run_dir, "attempt_start")
    assert [e["attempt"] for e in starts] == [1, 2], starts  # the leader's record: one restart for the job
    failures = events(pair.run_dir, "failure")
    assert len(failures) == 1 and failures[0]["attempt"] == 1, failures  # one incident, written once
    restart = events(pair.run_dir, "restart")
    assert len(restart) == 1 and restart[0]["snapshot_step"] >= 10, restart
    logs = pair.run_dir / "nodes"
    assert (logs / "node-0" / "logs" / "attempt-2").is_dir() and (logs / "node-1" / "logs" / "attempt-2").is_dir()
    rdzv = {p.name.split("_")[0] for node in (0, 1) for p in (logs / f"node-{node}" / "logs").glob("attempt-*/*_*")}
    assert rdzv == {"kill-a1", "kill-a2"}, rdzv  # a fresh rendezvous id per attempt
    verified = [e for e in events(pair.run_dir, "restart") if e.get("nodes") == [0, 1]]
    assert verified, "the restart's snapshot was not verified by both nodes"
    estimate = ckptrun("estimate-rto", str(pair.run_dir), "--json", cwd=tmp_path, timeout=200)
    document = json.loads(estimate.stdout)
    assert document["components"]["verify"]["nodes"] == 2 and document["node_loss"]["join"]["value_s"] == 300.0
    assert document["totals"]["rto_node_loss_s"] > document["totals"]["rto_s"]
    report = ckptrun("report", str(pair.run_dir), "-o", str(tmp_path / "kill.png"), cwd=tmp_path, timeout=200)
    assert report.returncode == 0 and (tmp_path / "kill.html").exists(), report.stderr


@pytest.mark.timeout(240)
def test_a_stop_from_node_1_stops_both_with_one_snapshot(tmp_path: Path, cleanup: Cleanup) -> None:
    pair = Pair(tmp_path, cleanup, "stop")
    pair.launch(job=["--", "--num-workers", "0", "--steps", "100000"])
    wait_for(lambda: any(e.get("step", 0) >= 3 for e in events(pair.run_dir, "snapshot_saved")) or
             len(final_losses(pair.run_dir)) >= 3, timeout=120, what="training on both nodes")
    status = json.loads(ckptrun("status", str(pair.run_dir), "--json", cwd=tmp_path).stdout)
    assert [n["node"] for n in status["nodes"]] == [0, 1] and all(n["alive"] for n in status["nodes"]), status
    assert sorted(r.get("node") for r in status["ranks"]) == [0, 1], status["ranks"]
    pair.procs[1].send_signal(signal.SIGTERM)
    assert (pair.wait(0), pair.wait(1)) == (3, 3), f"{pair.log(0)}\n{pair.log(1)}"
    stopped = events(pair.run_dir, "run_stopped")
    assert len(stopped) == 1 and stopped[0]["snapshot_step"] is not None, stopped


@pytest.mark.timeout(300)
def test_the_leader_killed_makes_node_1_exit_requeue_and_both_resume_exactly(tmp_path: Path, cleanup: Cleanup,
                                                                            reference: dict[int, float]) -> None:
    pair = Pair(tmp_path, cleanup, "lead")
    pair.launch()
    wait_for(lambda: any(e.get("step", 0) >= 5 for e in events(pair.run_dir, "snapshot_saved")), timeout=150,
             what="the first snapshot")
    os.kill(pair.procs[0].pid, signal.SIGKILL)
    code = pair.wait(1, timeout=60)
    if code == 0:
        pytest.skip("the job finished before the leader was killed (machine too fast for this schedule)")
    assert code == 5, pair.log(1)
    wait_for(lambda: not [p for p in _run_processes(pair.run_dir)], timeout=30, what="no orphans")
    for node in (0, 1):
        pair.start(node, "--latest", "--run-dir", str(pair.run_dir), "--node-rank", str(node), command="resume")
    assert (pair.wait(0), pair.wait(1)) == (0, 0), f"{pair.log(0)}\n{pair.log(1)}"
    assert_losses_equal(pair.run_dir, reference)
    lost = events(pair.run_dir, "leader_lost")
    assert [e["node"] for e in lost] == [1], lost


@pytest.mark.timeout(240)
def test_one_budget_unit_per_incident(tmp_path: Path, cleanup: Cleanup) -> None:
    pair = Pair(tmp_path, cleanup, "budget")
    pair.launch("--max-restarts", "1", "--inject-fault", "kill:rank=1:step=7;kill:rank=0:step=13:attempt=2")
    assert (pair.wait(0), pair.wait(1)) == (1, 1), f"{pair.log(0)}\n{pair.log(1)}"
    assert len(events(pair.run_dir, "restart")) == 1 and len(events(pair.run_dir, "gave_up")) == 1


@pytest.mark.timeout(120)
def test_a_node_that_does_not_see_the_leaders_checkpoint_dir_is_refused(tmp_path: Path, cleanup: Cleanup) -> None:
    pair = Pair(tmp_path, cleanup, "token")
    pair.start(0, *pair.flags(0), *QUICK, *JOB)
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "runs").symlink_to(tmp_path / "runs")  # the run dir is shared, the checkpoint dir is not
    popen = subprocess.run([*CKPTRUN, "launch", *pair.flags(1), *QUICK, "--ckpt-dir", str(other / "ckpt"), *JOB],
                           cwd=tmp_path, capture_output=True, text=True, timeout=100)
    assert popen.returncode == 2, popen.stderr
    assert "is not the storage node 0" in popen.stderr and "Traceback" not in popen.stderr


@pytest.mark.timeout(240)
def test_a_faked_slurm_environment_launches_the_same_job(tmp_path: Path, cleanup: Cleanup,
                                                         reference: dict[int, float]) -> None:
    pair = Pair(tmp_path, cleanup, "slurm-4242")
    for node in (0, 1):
        slurm = {"SLURM_NNODES": "2", "SLURM_NODEID": str(node), "SLURM_JOB_NODELIST": "127.0.0.1",
                 "SLURM_JOB_ID": "4242", "MASTER_PORT": str(pair.port)}
        pair.start(node, *QUICK, *JOB, env=slurm)
    assert (pair.wait(0), pair.wait(1)) == (0, 0), f"{pair.log(0)}\n{pair.log(1)}"
    assert_losses_equal(pair.run_dir, reference)


def _run_processes(run_dir: Path) -> list:
    from launch_helpers import run_processes

    return run_processes(run_dir)


def _rank_of(popen: subprocess.Popen) -> psutil.Process:
    """The (one) rank process under a launcher."""
    for process in psutil.Process(popen.pid).children(recursive=True):
        try:
            if "RANK" in process.environ() and "ckptrun.runtime.bootstrap" in " ".join(process.cmdline()):
                return process
        except psutil.Error:
            continue
    raise AssertionError("no rank process under the launcher")


def _agent_of(popen: subprocess.Popen) -> psutil.Process:
    """The launcher's running torchrun (the agent process of its attempt)."""
    def find() -> psutil.Process | None:
        for child in psutil.Process(popen.pid).children():
            if "ckptrun.cli.supervision.agent" in " ".join(child.cmdline()):
                return child
        return None
    return wait_for(find, timeout=60, what="the attempt's torchrun")


@pytest.mark.timeout(300)
def test_node_1s_supervisor_killed_and_relaunched_within_the_join_timeout_completes(
        tmp_path: Path, cleanup: Cleanup, reference: dict[int, float]) -> None:
    pair = Pair(tmp_path, cleanup, "rejoin")
    pair.launch("--node-join-timeout", "120")
    wait_for(lambda: any(e.get("step", 0) >= 5 for e in events(pair.run_dir, "snapshot_saved")), timeout=150,
             what="the first snapshot")
    os.kill(pair.procs[1].pid, signal.SIGKILL)  # the launcher alone: its ranks must notice and leave
    pair.procs[1].wait()
    pair.start(1, *pair.flags(1), *QUICK, *JOB)  # the scheduler relaunches node 1's launcher
    assert (pair.wait(0), pair.wait(1)) == (0, 0), f"{pair.log(0)}\n{pair.log(1)}"
    assert_losses_equal(pair.run_dir, reference)
    joined = events(pair.run_dir, "node_joined")
    assert [e["node"] for e in joined] == [1], joined
    assert len(events(pair.run_dir, "restart")) == 1


@pytest.mark.timeout(300)
def test_a_hang_on_node_1_is_detected_with_its_stack_dumped(tmp_path: Path, cleanup: Cleanup,
                                                            reference: dict[int, float]) -> None:
    pair = Pair(tmp_path, cleanup, "hang")
    pair.launch("--inject-fault", "hang:rank=1:step=12")
    assert (pair.wait(0), pair.wait(1)) == (0, 0), f"{pair.log(0)}\n{pair.log(1)}"
    assert_losses_equal(pair.run_dir, reference)
    failures = events(pair.run_dir, "failure")
    assert len(failures) == 1 and failures[0]["cause"] == "hang", failures
    dumps = [p for p in (pair.run_dir / "nodes").glob("node-*/logs/attempt-1/**/stderr.log")
             if "most recent call first" in p.read_text(errors="replace")]
    assert dumps, "no rank's stack was dumped"


@pytest.mark.timeout(300)
def test_node_1s_torchrun_killed_restarts_both_exactly(tmp_path: Path, cleanup: Cleanup,
                                                       reference: dict[int, float]) -> None:
    pair = Pair(tmp_path, cleanup, "agent")
    pair.launch()
    agent = _agent_of(pair.procs[1])
    wait_for(lambda: any(e.get("step", 0) >= 5 for e in events(pair.run_dir, "snapshot_saved")), timeout=150,
             what="the first snapshot")
    agent.kill()
    assert (pair.wait(0), pair.wait(1)) == (0, 0), f"{pair.log(0)}\n{pair.log(1)}"
    assert_losses_equal(pair.run_dir, reference)
    assert len(events(pair.run_dir, "restart")) == 1
    wait_for(lambda: not _run_processes(pair.run_dir), timeout=30, what="no orphans")


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
