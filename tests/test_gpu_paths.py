"""The CUDA paths, proved on CPU as far as CPU can prove them (issue: GPUs by construction).

What needs a GPU (NCCL, streams, pinned copies, device memory) is `make gpu-check`'s; here:
the agent and the standby run with the NVML-based CUDA check and make no CUDA call of their own
(torch.cuda functions patched to record, in a real agent that forks a real rank); a forked rank
that finds CUDA poisoned (C1's ``bad-fork`` fault) makes the agent spawn the ranks instead and
the run completes exactly; FSDP2 staging builds a host DTensor without ``from_local``; staging
on a GPU makes the training stream wait for its copies (as calls on recording stand-ins); a
BatchNorm DDP job under async saves, its script making its own process group (both orders),
resumes bitwise; a default group without a CPU backend gets a gloo group beside it;
``zero_grad_fraction`` on FSDP2 counts globally; torch's determinism error becomes one line and
exit 4; a forked rank closes inherited listening sockets and sets numpy's BLAS threads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import psutil
import pytest
import torch
import torch.distributed as dist

from ckptrun.cli.supervision import fork_fallback
from ckptrun.cli.supervision.attempt import AttemptProcess, torchrun_command
from ckptrun.cli.supervision.standby import Standby
from ckptrun.runtime import collectives, records
from ckptrun.runtime.env import RunEnv
from ckptrun.runtime.records import final_losses, read_events
from launch_helpers import COMMON, FIXTURES, Cleanup, ckptrun, wait_for
from workers import QUIET, run_id_for, run_job, shared_tensors
from ports import free_port

NVML = "PYTORCH_NVML_BASED_CUDA_CHECK"
BN_JOB = FIXTURES / "bn_ddp_job.py"
RECORDER = FIXTURES / "cuda_call_recorder.py"


def _plain_env() -> dict[str, str]:
    """This process's environment without C1 and without the NVML check (ckptrun must add it)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("CKPTRUN_") and k != NVML}


# --- item 1: warm workers never poison CUDA -------------------------------------------------


@pytest.mark.timeout(120)
def test_agent_and_standby_environments_carry_the_nvml_check(tmp_path: Path) -> None:
    standby = Standby(_plain_env(), tmp_path / "standby.log", "nvml-check")
    agent = AttemptProcess([sys.executable, "-c", "import time; time.sleep(60)"], _plain_env(), tmp_path / "console.log")
    try:
        for pid in (standby.pid, agent.popen.pid):  # a child read before its exec shows no environment yet
            environ = wait_for(lambda: psutil.Process(pid).environ(), timeout=30, what=f"pid {pid}'s environment")
            assert environ.get(NVML) == "1", environ
    finally:
        standby.dismiss()
        agent.popen.kill()
        agent.popen.wait()


@pytest.mark.timeout(240)
def test_agent_makes_no_cuda_call_before_it_forks_a_rank(tmp_path: Path) -> None:
    """A warm standby becomes the agent of a real 1-rank torchrun whose rank is forked from it; every
    ``torch.cuda`` function is patched in that process to record (the rank inherits the patch)."""
    calls, pid_dir = tmp_path / "calls.jsonl", tmp_path / "warm-ranks"
    script = tmp_path / "job.py"
    script.write_text("print('rank ran')\n")
    command = torchrun_command(tmp_path / "failures.json", ["--standalone", "--nproc-per-node", "1",
                                                           "--log-dir", str(tmp_path / "logs")], [str(script)], pid_dir)
    word = {"argv": command[3:], "env": {**_plain_env(), **QUIET, "CUDA_CALLS": str(calls)},
            "console_log": str(tmp_path / "console.log"), "cwd": str(tmp_path)}
    driver = subprocess.run([sys.executable, str(RECORDER), "--warm"], input=json.dumps(word) + "\n", text=True,
                            env={**_plain_env(), "CUDA_CALLS": str(calls)}, capture_output=True, timeout=200)
    log = (tmp_path / "console.log").read_text()
    assert driver.returncode == 0, log[-3000:]
    assert "rank ran" in log and (pid_dir / "rank-0.json").exists(), log[-2000:]  # a forked rank ran the script
    recorded = [json.loads(line) for line in calls.read_text().splitlines()]
    agent = [c for c in recorded if c["pid"] == c["agent_pid"]]
    ranks = [c for c in recorded if c["pid"] != c["agent_pid"]]
    assert any(c["name"] == "is_available" and "launcher" in c["caller"] for c in agent), recorded  # torchrun's own
    assert [c for c in agent if not c["nvml"]] == [], "a CUDA check in the agent without NVML: cuInit before the fork"
    assert [c for c in agent if c["ours"]] == [], "ckptrun's code touched torch.cuda in the agent"
    assert [c for c in agent if c["name"] in ("init", "_lazy_init", "set_device", "current_device")] == []
    assert any(c["name"] == "is_available" for c in ranks), "the forked rank asked (bind_local_device), after the fork"


@pytest.mark.e2e
@pytest.mark.timeout(420)
def test_bad_fork_falls_back_to_spawn_and_batchnorm_ddp_resumes_bitwise(tmp_path: Path, cleanup: Cleanup) -> None:
    """Items 1, 3 and 4 in two launches. Reference: warm (forked) ranks, the script's own gloo group made
    before ``ckr.init()``. Faulted: every forked rank sees ``_is_in_bad_fork()`` True (C1's ``bad-fork``), the
    agent spawns them instead (an event, one line), rank 1 is killed after step 7, attempt 2 (spawned from
    the start) resumes from step 5; the script makes its own group after ``ckr.init()``. Async saves
    throughout. Losses and every saved tensor (BatchNorm statistics included) equal the reference's."""
    flags = [*COMMON, "--async-save", "--keep-last", "10"]
    ref, run = cleanup.run_dir(tmp_path / "ref"), cleanup.run_dir(tmp_path / "faulted")
    done = ckptrun("launch", *flags, "--run-dir", str(ref), str(BN_JOB), "--own-group", "before", cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    faulted = ckptrun("launch", *flags, "--run-dir", str(run), "--inject-fault", "bad-fork;kill:rank=1:step=7",
                      str(BN_JOB), "--own-group", "after", cwd=tmp_path, timeout=300)
    assert faulted.returncode == 0, faulted.stderr[-3000:]
    [off] = read_events(run, fork_fallback.EVENT)
    # every forked rank is poisoned and exits at once; the first exit may end its peer before that one reports
    assert off["attempt"] == 1 and off["ranks"] and set(off["ranks"]) <= {0, 1}, off
    told = [line for line in faulted.stderr.splitlines() if "could not use CUDA" in line]
    assert len(told) == 1 and told[0].startswith("ckptrun: warning: attempt 1:"), faulted.stderr[-2000:]
    assert [e["attempt"] for e in read_events(run, "attempt_start")] == [1, 2]
    assert [e["step"] for e in read_events(run, "restored")] == [5]
    logs = run / "logs"
    assert sorted(p.name for p in logs.glob("attempt-1*/warm-ranks/bad-fork-rank-*.json")) == \
        [f"bad-fork-rank-{r}.json" for r in sorted(off["ranks"])], sorted(str(p) for p in logs.rglob("*"))[:40]
    assert not list(logs.glob("attempt-2*/warm-ranks/rank-*.json")), "attempt 2 forked its ranks again"
    assert not list(ref.rglob("bad-fork-rank-*.json"))
    assert final_losses(run) == final_losses(ref) and len(final_losses(ref)) == 12
    final = sorted((ref / "checkpoints").glob("step-*"))[-1].name
    expected, got = shared_tensors(ref / "checkpoints" / final), shared_tensors(run / "checkpoints" / final)
    assert any("running_mean" in k for k in expected) and any("num_batches_tracked" in k for k in expected)
    assert expected.keys() == got.keys() and [k for k in expected if not torch.equal(expected[k], got[k])] == []


def test_spawn_args_replace_the_fork_start_and_rename_a_fixed_rendezvous() -> None:
    forked = ["--nproc-per-node", "2", "--rdzv-id", "job-a3", "--max-restarts", "0", "--start-method", "fork",
              "--run-path", "/x/warm_start.py", "/logs/warm-ranks", "train.py", "--lr", "1"]
    assert fork_fallback.spawn_args(forked) == ["--nproc-per-node", "2", "--rdzv-id", "job-a3-spawned",
                                                "--max-restarts", "0", "-m", "ckptrun.runtime.worker.bootstrap",
                                                "train.py", "--lr", "1"]


def test_a_forked_rank_makes_its_local_rank_gpu_current(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fork does not carry the agent's device over (the agent never touched CUDA): the forked rank binds
    ``LOCAL_RANK``'s GPU itself, and with fewer GPUs than that, or none, binds nothing. CUDA as it would answer
    on a 2-GPU node; what the rank calls is recorded."""
    from ckptrun.runtime.worker.warm_start import bind_local_device

    calls: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    for local_rank in ("1", "0", "2"):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        bind_local_device()
    assert calls == [1, 0]  # LOCAL_RANK 2 has no GPU on this node: nothing bound
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    bind_local_device()
    assert calls == [1, 0]


def test_gpu_check_says_what_ran_one_rank_is_never_called_ddp() -> None:
    """make gpu-check's launch line says what ran: one rank has both groups and no DDP wrap, never "DDP over
    NCCL" (issue 22 item 6)."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
    try:
        from gpu_launch_checks import what_ran
    finally:
        sys.path.pop(0)
    assert what_ran(1) == "1 rank, group cpu:gloo,cuda:nccl, no DDP wrap (one rank)" and "DDP over" not in what_ran(1)
    assert what_ran(2) == "2 ranks, DDP over NCCL"


# --- item 2: FSDP2 staging stays on the host --------------------------------------------------


@pytest.fixture
def one_rank_group(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setattr(collectives, "_cpu_group", None)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_staging_a_dtensor_builds_a_host_dtensor_without_from_local(one_rank_group: None,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from ckptrun.runtime.checkpoint.staging import Stager

    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    weight = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    moved: list[object] = []
    monkeypatch.setattr(DTensor, "from_local", staticmethod(lambda *a, **k: moved.append(a) or DTensor.from_local(*a, **k)))
    stager = Stager()
    first = stager.stage({"w": weight})["w"]
    with torch.no_grad():
        weight.to_local().add_(1.0)
    second = stager.stage({"w": weight})["w"]
    assert moved == [], "staging called DTensor.from_local (on a CUDA mesh: a device copy of the state)"
    buffer = stager._buffers["w"]
    for staged in (first, second):
        assert isinstance(staged, DTensor) and staged.device == torch.device("cpu")
        assert staged.to_local().data_ptr() == buffer.data_ptr()  # the reused buffer itself, no copy
        assert staged.placements == weight.placements and staged.shape == weight.shape
    assert torch.equal(second.to_local(), weight.to_local())


def test_ddp_buffers_are_rank_0s_also_under_torch_compile(one_rank_group: None) -> None:
    """``torch.compile(DDP(model))`` holds DDP as ``_orig_mod``: its BatchNorm statistics are still rank 0's to save."""
    from torch.nn.parallel import DistributedDataParallel

    from ckptrun.runtime.checkpoint import train_state

    dist.init_process_group("gloo", rank=0, world_size=1)
    ddp = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3)))
    plain = train_state.first_rank_keys({"model": ddp})
    assert plain and plain <= set(train_state.collect({"model": ddp})[1])  # stored keys, as collect names them
    assert train_state.first_rank_keys({"model": torch.compile(ddp)}) == plain
    assert train_state.first_rank_keys({"model": ddp.module}) == frozenset()  # no DDP: every rank's copy is its own


# --- item 3: what staging fences on a GPU, as calls (the streams themselves need `make gpu-check`) -----------


class _CudaLooking(torch.Tensor):
    """A CPU tensor that says it is on CUDA and records ``record_stream`` (torch.cuda itself is not touched)."""

    log: list[tuple] = []

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    def record_stream(self, stream: object) -> None:  # type: ignore[override]
        self.log.append(("record_stream", stream))


def test_staging_on_a_gpu_makes_the_training_stream_wait_for_its_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptrun.runtime.checkpoint import staging

    log: list[tuple] = []
    _CudaLooking.log = log

    class Stream:
        def __init__(self, name: str = "side") -> None:
            self.name = name

        def wait_stream(self, other: "Stream") -> None:
            log.append(("wait_stream", self.name, other.name))

        def wait_event(self, event: "Event") -> None:
            log.append(("wait_event", self.name, event.stream))

    class Event:
        stream = None

        def record(self, stream: Stream) -> None:
            self.stream = stream.name
            log.append(("event_record", stream.name))

        def synchronize(self) -> None:
            log.append(("cpu_waits", self.stream))

    training = Stream("training")
    real_empty = torch.empty
    monkeypatch.setattr(staging.torch.cuda, "Stream", Stream)
    monkeypatch.setattr(staging.torch.cuda, "Event", Event)
    monkeypatch.setattr(staging.torch.cuda, "current_stream", lambda: training)
    monkeypatch.setattr(staging.torch.cuda, "stream", lambda s: __import__("contextlib").nullcontext())
    monkeypatch.setattr(staging.torch, "empty", lambda *a, pin_memory=False, **k: log.append(("pinned", pin_memory))
                        or real_empty(*a, **k))
    stager = staging.Stager()
    source = torch.arange(6.0).as_subclass(_CudaLooking)
    staged = stager.stage({"bn.running_mean": source})
    assert torch.equal(staged["bn.running_mean"], torch.arange(6.0))
    side = stager._stream
    assert log == [("wait_stream", "side", "training"), ("pinned", True), ("record_stream", side),
                   ("event_record", "side"), ("wait_event", "training", "side")], log  # no CPU wait in stage()
    stager.fence()  # the writer's wait, before it reads the buffers
    assert log[-1] == ("cpu_waits", "side")


# --- item 4: a default group without a CPU backend ------------------------------------------------


@pytest.mark.parametrize("config, carries_cpu", [("gloo", True), ("nccl", False), ("cpu:gloo,cuda:nccl", True),
                                                 ("cuda:nccl", False), ("cuda:gloo", False), ("mpi", True)])
def test_which_backend_configs_carry_cpu_tensors(config: str, carries_cpu: bool) -> None:
    assert collectives.has_cpu_backend(config) is carries_cpu


def test_a_default_group_without_a_cpu_backend_gets_a_gloo_group(one_rank_group: None,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    dist.init_process_group("cuda:gloo", rank=0, world_size=1)  # a real group with no CPU backend, as NCCL-only
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        dist.all_reduce(torch.ones(1))  # what the runtime's decisions would have hit
    with monkeypatch.context() as no_gloo:
        no_gloo.setattr(dist, "is_gloo_available", lambda: False)
        with pytest.raises(collectives.NoCpuBackend, match='backend="cpu:gloo,cuda:nccl"'):
            collectives.ensure_cpu_group()
    group = collectives.ensure_cpu_group()
    assert group is not None and dist.get_backend(group) == "gloo" and collectives.ensure_cpu_group() is group
    monkeypatch.setattr(collectives.dist, "get_world_size", lambda group=None: 2)  # a sum that goes over the wire
    assert collectives.all_reduce_sum([1.5, 2.0]) == [1.5, 2.0]
    assert collectives.broadcast_object({"snapshot": 5}) == {"snapshot": 5}


# --- item 5: zero_grad_fraction on FSDP2 ------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_zero_grad_fraction_on_fsdp2_counts_globally_in_one_reduction(tmp_path: Path) -> None:
    out = tmp_path / "fractions"
    result = run_job(tmp_path / "run", nproc=2, script=FIXTURES / "zero_grads_fsdp.py", args=(str(out),))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for row in rows:
        assert row["none_zero"] == 0.0, row  # the old count (local nonzero / global size) read 0.5 on 2 ranks
        assert row["some_zero"] == row["expected"] > 0, row
        assert row["reductions"] == 1, row
    assert rows[0]["some_zero"] == rows[1]["some_zero"]


def test_zero_gradients_are_counted_on_the_decision_cadence() -> None:
    from ckptrun.runtime.step.stepper import zero_count_due

    assert [s for s in range(12) if zero_count_due(s, 4)] == [3, 7, 11]
    assert all(zero_count_due(s, 1) for s in range(5))


def test_a_rank_without_gradients_still_joins_the_zero_count_reduction(monkeypatch: pytest.MonkeyPatch) -> None:
    """The other ranks wait in the reduction: a rank whose parameters got no gradient must not skip it."""
    import torch

    from ckptrun.runtime import collectives
    from ckptrun.runtime.step import stepper

    calls: list[list[float]] = []
    monkeypatch.setattr(collectives, "all_reduce_sum", lambda values: calls.append(values) or [0.0, 6.0])
    assert stepper._zero_fraction([torch.nn.Parameter(torch.ones(2, 3))]) == 1.0  # no .grad here, six elsewhere
    assert calls == [[0.0, 0.0]]


# --- item 7: an op without a deterministic kernel -----------------------------------------------


@pytest.mark.timeout(120)
def test_nondeterministic_op_is_one_line_two_ways_out_and_exit_4(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text("import ckptrun.runtime as ckr\nimport torch._prims_common as prims\nrun = ckr.init()\n"
                      "prims.alert_not_deterministic('index_add_cuda_')  # torch's own check, as a CUDA kernel calls it\n")
    run_dir = tmp_path / "run"
    env = {**_plain_env(), **QUIET, **RunEnv(run_id=run_id_for(run_dir), run_dir=run_dir).to_env()}
    result = subprocess.run([sys.executable, "-m", "ckptrun.runtime.worker.bootstrap", str(script)], env=env,
                            capture_output=True, text=True, timeout=100)
    assert result.returncode == 4, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith(("error:", "hint:"))]
    assert lines[0].startswith("error: index_add_cuda_ has no deterministic implementation"), result.stderr
    assert "--no-deterministic" in lines[1] and "alternative" in lines[1]
    assert "Traceback" not in result.stderr
    [fatal] = records.read_fatal(run_dir)
    assert fatal["exit_code"] == 4 and "index_add_cuda_" in fatal["reason"]


# --- item 8: what a forked rank undoes ------------------------------------------------------------


@pytest.mark.timeout(120)
def test_forked_rank_closes_inherited_listeners_and_sets_blas_threads(tmp_path: Path) -> None:
    child = """
import json, os, socket, sys
import numpy
from ckptrun.runtime.worker import fork_safety, warm_start
listener = socket.socket(); listener.bind(("127.0.0.1", 0)); listener.listen()
fork_safety.limit_blas_threads(2)  # the agent's pool: as many threads as it was given
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    os.environ["OMP_NUM_THREADS"] = "1"  # what torchrun sets for the rank after the agent loaded numpy
    fds = lambda: sorted(f for f in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{f}"))  # not the listing's own
    before = fds()
    closed = fork_safety.close_inherited_listeners()
    left = fds()
    warm_start.apply_threads()
    import torch
    os.write(write, json.dumps({"closed": closed, "fd": listener.fileno(), "before": before, "left": left,
                                "blas": fork_safety.openblas_threads(),
                                "torch": torch.get_num_threads()}).encode())
    os._exit(0)
os.waitpid(pid, 0)
facts = json.loads(os.read(read, 4096))
facts["parent_listens"] = listener.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
print(json.dumps(facts))
"""
    result = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=100,
                            env={**_plain_env(), "OMP_NUM_THREADS": "2"})
    assert result.returncode == 0, result.stderr[-2000:]
    facts = json.loads(result.stdout)
    assert facts["closed"] == [facts["fd"]] and facts["parent_listens"] == 1
    # nothing else closed and no descriptor left open by the probe (a leaked duplicate of the agent's sentinel
    # pipe outlived a SIGKILLed rank in its loader workers and hid its death from torchrun)
    assert sorted(set(facts["before"]) - set(facts["left"])) == [str(facts["fd"])] and set(facts["left"]) <= set(facts["before"])
    assert facts["torch"] == 1 and facts["blas"] and set(facts["blas"]) == {1}, facts
