"""Restoring the state: ckptrun (one verification + the safe loader) against ``torch.load``.

Same state, same world size (1), same cache state, interleaved per repeat:

* ``restore_s`` — ``verify_snapshot`` (every file hashed against the manifest,
  sha256) then ``snapshot.load`` (restricted DCP reader, weights-only
  ``torch.load`` of the RNG file, JSON), files evicted from the page cache first;
* ``torch_load_s`` — ``torch.load(weights_only=True)`` of the same state, evicted;
* ``*_cached_s`` — both again with every file read once beforehand;
* ``restore_blake3_s`` / ``restore_blake3_cached_s`` — a blake3 snapshot.

Neither side copies the loaded tensors into a model (``Run.restore`` does, one
memory copy more); both stop when the tensors are in memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from common import CACHED, EVICTED, Figure, evict, interleave, warm
from snapshots import Snapshots


def restore_once(path: Path) -> float:
    from ckptrun.runtime import snapshot
    from ckptrun.runtime.verify import verify_snapshot

    started = time.perf_counter()
    report = verify_snapshot(path)
    if not report.ok:
        raise RuntimeError(f"{path} does not verify: {report.problems[:2]}")
    loaded = snapshot.load(path)
    seconds = time.perf_counter() - started
    del loaded
    return seconds


def torch_load_once(path: Path) -> float:
    import torch

    started = time.perf_counter()
    loaded = torch.load(path, map_location="cpu", weights_only=True)
    seconds = time.perf_counter() - started
    del loaded
    return seconds


def _trial(key: str, path: Path, load: Callable[[Path], float], cached: bool) -> Callable[[], dict[str, float]]:
    def run() -> dict[str, float]:
        (warm if cached else evict)(path)
        return {key: load(path)}

    return run


def measure(snaps: Snapshots, repeats: int) -> dict[str, Figure]:
    assert snaps.torch_file is not None
    trials = {}
    for cached, suffix in ((False, ""), (True, "_cached")):
        trials[f"torch_load{suffix}_s"] = _trial(f"torch_load{suffix}_s", snaps.torch_file, torch_load_once, cached)
        for algorithm, path in snaps.w1.items():
            name = "restore" if algorithm == "sha256" else f"restore_{algorithm}"
            trials[f"{name}{suffix}_s"] = _trial(f"{name}{suffix}_s", path, restore_once, cached)
    samples = interleave(repeats, trials)
    figures = {}
    for key, values in samples.items():
        hashed = "blake3" if "blake3" in key else "sha256"
        note = "torch.load(weights_only=True)" if key.startswith("torch_load") else f"verify ({hashed}) + snapshot.load"
        figures[key] = Figure(values, "s", CACHED if "cached" in key else EVICTED, note=note)
    return figures
