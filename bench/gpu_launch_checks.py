"""`make gpu-check`'s end-to-end half: real `ckptrun launch` runs on every visible GPU.

Each check is a supervised run that is killed and resumed by the supervisor,
compared with an uninterrupted run of the same job: per-step losses must be
bitwise equal (bf16 and fp16 DDP over NCCL, and the FSDP2 template). The
staging check saves asynchronously while the next steps keep changing the
weights, and compares every published snapshot with the weights each rank
wrote down at that step.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ckptrun.runtime.records import final_losses, read_events, same_float

CKPTRUN = [sys.executable, "-m", "ckptrun.cli.main"]
JOB = Path(__file__).parent / "gpu_job.py"
# a loaded GPU machine: generous allowances; a short back-off
COMMON = ["--heartbeat-timeout", "120", "--startup-timeout", "600", "--restart-backoff", "0.1", "--keep-last", "100"]


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    result = subprocess.run([*CKPTRUN, *args], cwd=cwd, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise AssertionError(f"`ckptrun {' '.join(args)}` exited {result.returncode}:\n{result.stderr[-3000:]}")
    return result


def exact_resume(label: str, script: Path, script_args: list[str], precision: str, nproc: int, scratch: Path) -> None:
    """Killed on rank 0 after step 7 (snapshot at 5), resumed by the supervisor: losses equal the uninterrupted run's."""
    flags = ["--nproc-per-node", str(nproc), "--precision", precision, "--save-every-steps", "5", *COMMON]
    ref, killed = scratch / f"{label}-ref", scratch / f"{label}-killed"
    cli("launch", *flags, "--run-dir", str(ref), str(script), *script_args, cwd=scratch)
    cli("launch", *flags, "--run-dir", str(killed), "--inject-fault", "kill:rank=0:step=7", str(script), *script_args,
        cwd=scratch)
    restarts = read_events(killed, "restart")
    assert len(restarts) == 1, f"{label}: expected one restart, saw {len(restarts)}"
    expected, got = final_losses(ref), final_losses(killed)
    assert expected.keys() == got.keys(), f"{label}: steps {sorted(expected)} vs {sorted(got)}"
    differ = [s for s in expected if not same_float(expected[s], got[s])]
    assert not differ, f"{label}: losses differ at steps {differ} ({expected[differ[0]]!r} vs {got[differ[0]]!r})"
    print(f"ok  {label} on {nproc} GPU(s): killed after step 7, resumed from step 5, "
          f"{len(expected)} losses bitwise equal to the uninterrupted run")


def staging_under_load(nproc: int, scratch: Path, hidden: int = 2048) -> None:
    """Async saves of a ~34M-parameter model while the next steps run: each snapshot holds the step's weights."""
    expect, run_dir = scratch / "expect", scratch / "staging"
    expect.mkdir()
    cli("launch", "--nproc-per-node", str(nproc), "--precision", "bf16", "--save-every-steps", "3", "--async-save",
        *COMMON, "--run-dir", str(run_dir), str(JOB), "--steps", "15", "--hidden", str(hidden), "--layers", "8",
        "--save-every", "3", "--expect-dir", str(expect), cwd=scratch)
    snapshots = sorted((run_dir / "checkpoints").glob("step-*"))
    assert len(snapshots) == 5, f"expected 5 snapshots, found {[p.name for p in snapshots]}"
    for snapshot in snapshots:
        step = int(snapshot.name.split("-")[1])
        cli("export", str(snapshot), "-o", str(scratch / "saved.pt"), cwd=scratch)
        saved = torch.load(scratch / "saved.pt", weights_only=True)
        for rank in range(nproc):  # DDP: every rank's weights are the replicated state
            at_step = torch.load(expect / f"step-{step}-rank{rank}.pt", weights_only=True)
            torn = [k for k in at_step if not torch.equal(saved[k], at_step[k])]
            assert not torn, f"snapshot {snapshot.name} differs from rank {rank}'s weights at step {step}: {torn}"
    print(f"ok  staging under load: {len(snapshots)} async snapshots equal the weights at their step on every rank")


def run_all(nproc: int) -> None:
    scratch = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    for precision in ("bf16", "fp16"):
        exact_resume(f"DDP {precision}", JOB, ["--steps", "12"], precision, nproc, scratch)
    cli("init", str(scratch / "fsdp"), "--template", "fsdp", cwd=scratch)
    exact_resume("FSDP2 bf16", scratch / "fsdp" / "train.py", ["--steps", "12"], "bf16", nproc, scratch)
    staging_under_load(nproc, scratch)
