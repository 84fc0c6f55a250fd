"""Start real worker processes (plain python or torchrun) for runtime tests, and never leak them.

Every process starts in its own session and carries CKPTRUN_RUN_ID, so a test
can find and kill what it started even when a rank was orphaned.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil

import torch.distributed.checkpoint as dcp
from ckptrun.cli.supervision.attempt import processes_of_run
from ckptrun.runtime.checkpoint.dcp_io import SafeReader, allocate_from_metadata, load_metadata
from ckptrun.runtime.env import RunEnv

TEMPLATE = "ckptrun.templates.default_job"
QUIET = {"PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def kill_run(run_id: str) -> None:
    for process in processes_of_run(run_id):
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def dump_stacks(run_id: str) -> list[str]:
    """Ask every process of the run for its Python stacks (the runtime's SIGUSR2 faulthandler, written to its
    stderr) and wait until they are written; returns the processes as ``pid:name``."""
    processes = [p for p in processes_of_run(run_id) if "torch.distributed.run" not in p.cmdline()]  # ranks only:
    for process in processes:  # the agent has no handler and would die of the signal
        with contextlib.suppress(psutil.Error):
            process.send_signal(signal.SIGUSR2)
    psutil.wait_procs(processes, timeout=3)  # a dump takes milliseconds: this gives it time (they rarely exit)
    names = []
    for process in processes:
        with contextlib.suppress(psutil.Error):
            names.append(f"{process.pid}:{' '.join(process.cmdline()[1:4])}")
    return names


def run_id_for(run_dir: Path) -> str:
    """Stable for one run dir (attempts share it), unique across tests (cleanup kills by run id)."""
    return f"{run_dir.name}-{hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:10]}"


def run_job(run_dir: Path, nproc: int = 1, args: tuple[str, ...] = (), timeout: float = 120,
            module: str = TEMPLATE, script: Path | None = None, torchrun: bool = False, **env_fields: object) -> Result:
    """Run a worker script under plain python (nproc=1 without ``torchrun``) or torchrun, with C1 fields from ``env_fields``."""
    fields = {"run_id": run_id_for(run_dir), "run_dir": run_dir, "threads": 1, **env_fields}
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTRUN_")}
    env.update(QUIET)
    env.update(RunEnv(**fields).to_env())
    target = [str(script)] if script else ["-m", module]
    if nproc == 1 and not torchrun:
        command = [sys.executable, *target, *args]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   "--max-restarts=0", *target, *args]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        alive = dump_stacks(str(fields["run_id"]))  # what each process was doing, for the failure message
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        kill_run(str(fields["run_id"]))
        out, err = process.communicate()
        raise AssertionError(f"worker timed out after {timeout}s; still running: {alive}\n{err[-8000:]}") from None
    finally:
        kill_run(str(fields["run_id"]))
    return Result(process.returncode, out, err)


def shared_tensors(snapshot_dir: Path) -> dict:
    """Every DCP tensor of a snapshot, loaded in this (single) process through the safe reader."""
    metadata = load_metadata(snapshot_dir / "dcp")
    tensors = allocate_from_metadata(metadata, list(metadata.state_dict_metadata))
    dcp.load(tensors, storage_reader=SafeReader(snapshot_dir / "dcp"), no_dist=True)
    return tensors
