"""Restoring the state: ckptrun (what a restart does, every byte verified once) against ``torch.load``.

Same state, same world size (1), same cache state, interleaved per repeat:

* ``restore_s`` — what a restart runs: the pre-relaunch check
  (``verify_snapshot(at_load=True)``: manifest and sizes, since the snapshot is
  chunked) then ``snapshot.load``, which reads each byte once and checks it
  against its chunk digest (sha256) as it is read (restricted DCP reader,
  weights-only ``torch.load``, JSON), files evicted from the page cache first;
* ``restore_full_verify_s`` — a full ``verify_snapshot`` (every file hashed, what
  ``ckptrun verify`` runs) then the same load, which hashes again: the old path's cost plus one hash;
* ``torch_load_s`` — ``torch.load(weights_only=True)`` of the same state, evicted;
* ``read_floor_s`` — the least a verified restore can take: every byte of the
  snapshot's files read with ``preadv`` into buffers that already exist and
  hashed (sha256), in the loader's pieces on the loader's threads, evicted;
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


def restore_once(path: Path, full_verify: bool = False) -> float:
    from ckptrun.runtime.checkpoint import snapshot
    from ckptrun.runtime.checkpoint.verify import verify_snapshot

    started = time.perf_counter()
    report = verify_snapshot(path, at_load=not full_verify)
    if not report.ok:
        raise RuntimeError(f"{path} does not verify: {report.problems[:2]}")
    loaded = snapshot.load(path)
    seconds = time.perf_counter() - started
    del loaded
    return seconds


def read_floor_trial(path: Path) -> Callable[[], dict[str, float]]:
    """``read_floor_s``: buffers made once (outside the timing), then each file evicted, read and hashed."""
    import hashlib
    import mmap
    import os
    from concurrent.futures import ThreadPoolExecutor

    from ckptrun.runtime.checkpoint.verified_read import HASH_THREADS, PIECE

    files = sorted(p for p in path.rglob("*") if p.is_file())
    buffers = {p: memoryview(mmap.mmap(-1, max(1, p.stat().st_size))) for p in files}
    for buffer in buffers.values():  # touched once: the floor reads into memory that exists
        buffer[::4096] = b"\0" * len(buffer[::4096])

    def piece(fd: int, buffer: memoryview, offset: int) -> str:
        view = buffer[offset:offset + PIECE]
        os.preadv(fd, [view], offset)
        return hashlib.sha256(view).hexdigest()

    def run() -> dict[str, float]:
        evict(path)
        started = time.perf_counter()
        with ThreadPoolExecutor(HASH_THREADS) as pool:
            for file in files:
                with open(file, "rb", buffering=0) as stream:
                    size = file.stat().st_size
                    os.posix_fadvise(stream.fileno(), 0, size, os.POSIX_FADV_WILLNEED)  # the kernel reads ahead
                    list(pool.map(lambda offset: piece(stream.fileno(), buffers[file], offset), range(0, size, PIECE)))
        return {"read_floor_s": time.perf_counter() - started}

    return run


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
    trials["read_floor_s"] = read_floor_trial(snaps.w1["sha256"])
    trials["restore_full_verify_s"] = _trial("restore_full_verify_s", snaps.w1["sha256"],
                                             lambda path: restore_once(path, full_verify=True), False)
    samples = interleave(repeats, trials)
    figures = {}
    for key, values in samples.items():
        hashed = "blake3" if "blake3" in key else "sha256"
        note = ("torch.load(weights_only=True)" if key.startswith("torch_load") else
                "preadv into existing buffers + sha256, the loader's pieces on its threads" if key == "read_floor_s" else
                f"full verify ({hashed}) + snapshot.load (hashing again)" if "full_verify" in key else
                f"manifest and sizes + snapshot.load verifying each chunk ({hashed}) as read")
        figures[key] = Figure(values, "s", CACHED if "cached" in key else EVICTED, note=note)
    return figures
