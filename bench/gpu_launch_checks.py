"""`make gpu-check`'s end-to-end half: real `ckptrun launch` runs on the visible GPUs.

Each check is a supervised run killed after step 7 and resumed by the supervisor from step 5,
compared with an uninterrupted run of the same job: per-step losses and every tensor of the
final snapshot must be bitwise equal. With warm workers (the default) the ranks are forked
from the agent: the check also requires that they were (pid files), that none fell back to
spawned ranks, and that CUDA worked in them. On one GPU there is one rank: the process group is
``cpu:gloo,cuda:nccl`` but DDP is not wrapped (a rank alone has nothing to reduce) — the rows
say so. Async saves throughout (the default), with BatchNorm in the job (in-place writes in the
forward that follows a save's staging).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from ckptrun.runtime.records import final_losses, read_events, same_float

CKPTRUN = [sys.executable, "-m", "ckptrun.cli.main"]
JOB = Path(__file__).parent / "gpu_job.py"
# a loaded GPU machine: generous allowances; a short back-off
COMMON = ["--heartbeat-timeout", "120", "--startup-timeout", "300", "--restart-backoff", "0.1", "--keep-last", "100"]
LAUNCH_TIMEOUT_S = 240


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    result = subprocess.run([*CKPTRUN, *args], cwd=cwd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    if result.returncode != 0:
        raise AssertionError(f"`ckptrun {' '.join(args[:6])} …` exited {result.returncode}: {result.stderr[-1500:]}")
    return result


def what_ran(nproc: int) -> str:
    return f"{nproc} ranks, DDP over NCCL" if nproc > 1 else "1 rank, group cpu:gloo,cuda:nccl, no DDP wrap (one rank)"


def _final_tensors(run_dir: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint import load as dcp_load

    from ckptrun.runtime.checkpoint.dcp_io import SafeReader, allocate_from_metadata, load_metadata

    final = sorted((run_dir / "checkpoints").glob("step-*"))[-1] / "dcp"
    metadata = load_metadata(final)
    tensors = allocate_from_metadata(metadata, list(metadata.state_dict_metadata))
    dcp_load(tensors, storage_reader=SafeReader(final), no_dist=True)
    return tensors


def exact_resume(label: str, script: Path, script_args: list[str], precision: str, nproc: int,
                 scratch: Path) -> tuple[bool, str, dict[str, Any]]:
    """Killed on rank 0 after step 7 (snapshot at 5), resumed: losses and final tensors equal the uninterrupted run's."""
    flags = ["--nproc-per-node", str(nproc), "--precision", precision, "--save-every-steps", "5", *COMMON]
    ref, killed = scratch / f"{label}-ref", scratch / f"{label}-killed"
    cli("launch", *flags, "--run-dir", str(ref), str(script), *script_args, cwd=scratch)
    cli("launch", *flags, "--run-dir", str(killed), "--inject-fault", "kill:rank=0:step=7", str(script), *script_args,
        cwd=scratch)
    restarts, fallbacks = read_events(killed, "restart"), read_events(killed, "warm_workers_off") + read_events(ref, "warm_workers_off")
    forked = sorted(p.name for p in (killed / "logs").glob("attempt-*/warm-ranks/rank-*.json"))
    expected, got = final_losses(ref), final_losses(killed)
    differ = [s for s in expected if s not in got or not same_float(expected[s], got[s])]
    saved_ref, saved_got = _final_tensors(ref), _final_tensors(killed)
    torn = [k for k in saved_ref if k not in saved_got or not torch.equal(saved_ref[k], saved_got[k])]
    detail = {"restarts": len(restarts), "losses": len(expected), "losses_differ": differ[:5], "tensors": len(saved_ref),
              "tensors_differ": torn[:5], "forked_rank_files": forked, "warm_workers_off": fallbacks,
              "what_ran": what_ran(nproc)}
    passed = len(restarts) == 1 and not differ and not torn and len(forked) >= 2 * nproc and not fallbacks
    figure = (f"{what_ran(nproc)}; warm (forked) ranks in both attempts: {len(forked) >= 2 * nproc}; "
              f"{len(expected) - len(differ)}/{len(expected)} losses and {len(saved_ref) - len(torn)}/{len(saved_ref)} "
              "final tensors bitwise equal")
    return passed, figure, detail


def fsdp_template(nproc: int, scratch: Path) -> tuple[bool, str, dict[str, Any]]:
    cli("init", str(scratch / "fsdp"), "--template", "fsdp", cwd=scratch)
    return exact_resume("fsdp2-bf16", scratch / "fsdp" / "train.py", ["--steps", "12"], "bf16", nproc, scratch)
