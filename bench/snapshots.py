"""The files the read-side benchmarks read, written once per size.

* world size 1: a ckptrun snapshot per hash algorithm (one DCP tensor file
  holds nearly all bytes) and a ``torch.save`` file of the same state;
* world size 2: ckptrun snapshots written by two gloo ranks holding the same
  replicated state; DCP spreads the tensors over one file per rank, which is
  the multi-file case parallel verification is for (``multirank.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from common import BigState, free_port, save_once, write_fsync

HERE = Path(__file__).resolve().parent


@dataclass
class Snapshots:
    w1: dict[str, Path] = field(default_factory=dict)  # algorithm -> snapshot dir
    w2: dict[str, Path] = field(default_factory=dict)  # algorithm -> snapshot dir
    torch_file: Path | None = None
    all_reduce_s: list[float] = field(default_factory=list)  # per-call medians of all_reduce_sum, 2 ranks
    w2_error: str | None = None


def write_w1(state: BigState, ckpt_dir: Path, algorithm: str) -> Path:
    from ckptrun.runtime.checkpoint.saver import Saver

    saver = Saver(ckpt_dir, algorithm, asynchronous=False)
    save_once(saver, state)
    result = saver.collect(wait=True)[-1]
    if not result.ok:
        raise RuntimeError(f"ckptrun save failed: {result.error}")
    return result.path


def write_torch(state: BigState, path: Path) -> Path:
    import torch

    write_fsync(path, lambda stream: torch.save(state.natural_state_dict(), stream))
    return path


def write_w2(nbytes: int, out: Path, algorithms: list[str], repeats: int) -> tuple[dict[str, Path], list[float]]:
    """Two ranks (plain subprocesses, gloo on localhost) write one snapshot per algorithm."""
    port = free_port()
    command = [sys.executable, str(HERE / "multirank.py"), "--bytes", str(nbytes), "--out", str(out), "--port", str(port),
               "--algorithms", ",".join(algorithms), "--repeats", str(repeats), "--world", "2"]
    procs = [subprocess.Popen([*command, "--rank", str(rank)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    outputs = [proc.communicate(timeout=900) for proc in procs]
    for proc, (_, err) in zip(procs, outputs):
        if proc.returncode != 0:
            raise RuntimeError(f"2-rank snapshot writer failed ({proc.returncode}): {err.strip().splitlines()[-1] if err.strip() else ''}")
    report = json.loads(outputs[0][0].strip().splitlines()[-1])
    return {algorithm: Path(path) for algorithm, path in report["snapshots"].items()}, report["all_reduce_s"]


def prepare(state: BigState, scratch: Path, algorithms: list[str], repeats: int) -> Snapshots:
    snaps = Snapshots()
    try:
        snaps.w2, snaps.all_reduce_s = write_w2(state.nbytes, scratch / "w2", algorithms, repeats)
    except (RuntimeError, subprocess.TimeoutExpired, ValueError, KeyError) as exc:
        snaps.w2_error = str(exc)
    for algorithm in algorithms:
        snaps.w1[algorithm] = write_w1(state, scratch / f"w1-{algorithm}", algorithm)
    snaps.torch_file = write_torch(state, scratch / "state.pt")
    return snaps
