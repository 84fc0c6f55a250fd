"""The cost of the state checks of issue 24 against the save's stall, in one run: the staged-floats finiteness
check and the replica digest.

The stall of an async save is the stage: a copy of every float into the reused host buffers
(``Stager.stage``). The check (``staging.first_nonfinite``: one fused ``_foreach_norm(inf)`` over those
buffers) runs on the writer thread before persist, so an async save's stall does not pay it at all; a
sync save (and a GPU's on-device scan) would: its stall is the whole save, whose floor is timed here as
``torch.save`` + fsync of the same tensors. Printed: the medians over interleaved repeats and their
ratios, for a model-like set of tensors (many of them small); the goal (check ≤ 2 % of the stall) with
PASS/MISS for both save modes. The replica digest (``replicas.digests``: a bit
sum per tensor, every rank, in the foreground) is in every multi-rank save's stall. Run:
``python bench/finite_check.py [MiB]``.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from ckptrun.runtime.checkpoint.replicas import digests
from ckptrun.runtime.checkpoint.staging import Stager, first_nonfinite


def state(mib: int) -> dict[str, torch.Tensor]:
    """``mib`` MiB of fp32 in tensors of a transformer's shapes: a few large, many small."""
    tensors, total, index = {}, 0, 0
    while total < mib << 20:
        big = torch.randn(512, 1024)
        tensors[f"w{index}"], tensors[f"b{index}"], tensors[f"n{index}"] = big, torch.randn(1024), torch.randn(1024)
        total += (big.numel() + 2048) * 4
        index += 1
    return tensors


def main(mib: int = 256, repeats: int = 7) -> None:
    tensors, stager = state(mib), Stager()
    staged = stager.stage(tensors)  # buffers allocated once, as every save after the first
    samples: dict[str, list[float]] = {"stage": [], "check": [], "digest": [], "sync": []}
    target = Path(tempfile.mkdtemp(prefix="ckptrun-finite-")) / "state.pt"
    order = list(samples)
    for repeat in range(repeats):
        for which in order[repeat % 4:] + order[:repeat % 4]:  # rotated per repeat
            started = time.perf_counter()
            if which == "stage":
                staged = stager.stage(tensors)
            elif which == "check":
                assert first_nonfinite(staged) is None
            elif which == "sync":
                _save_and_fsync(staged, target)
            else:
                assert digests(tensors)
            samples[which].append(time.perf_counter() - started)
    target.unlink(missing_ok=True)
    target.parent.rmdir()
    stage_s, check_s, digest_s = samples["stage"], samples["check"], samples["digest"]
    stage, check, digest, sync = (statistics.median(v) for v in (stage_s, check_s, digest_s, samples["sync"]))
    print(f"state {mib} MiB fp32 in {len(tensors)} tensors, CPU, {torch.get_num_threads()} threads, {repeats} interleaved repeats")
    print(f"stage (the async stall)  median {stage * 1e3:8.2f} ms  (min {min(stage_s) * 1e3:.2f}, max {max(stage_s) * 1e3:.2f})")
    print(f"finite check             median {check * 1e3:8.2f} ms  (min {min(check_s) * 1e3:.2f}, max {max(check_s) * 1e3:.2f})")
    print(f"replica digest           median {digest * 1e3:8.2f} ms  (min {min(digest_s) * 1e3:.2f}, max {max(digest_s) * 1e3:.2f})")
    print(f"sync save floor          median {sync * 1e3:8.2f} ms  (torch.save + fsync of the staged tensors)")
    print(f"check / stage            {check / stage:.3f}   (what a check inside the stage would add)")
    print("finite check, async save (default): not in the stall (Saver.begin's work() runs it on the writer thread)")
    ratio = check / (stage + check + sync)
    print(f"finite check, sync save: {ratio:.3f} of the stall (stage + check + write floor)   "
          f"{'PASS' if ratio <= 0.02 else 'MISS'} (goal <= 0.02)")
    print(f"digest / stage           {digest / stage:.3f}   (in the stall of every multi-rank save)")


def _save_and_fsync(tensors: dict[str, torch.Tensor], target: Path) -> None:
    with open(target, "wb") as handle:
        torch.save(tensors, handle)
        handle.flush()
        os.fsync(handle.fileno())


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 256)
