"""How fast ``ckptrun verify`` checks a snapshot, against hashing the same bytes on one thread.

Interleaved per repeat, on the multi-file snapshot written by two ranks
(``snapshots.py``), page-cached and evicted:

* ``verify_gbps`` — bytes / seconds of ``verify_snapshot`` (what ``ckptrun
  verify`` runs: files hashed in parallel threads, sizes, unlisted files);
* ``sha256_1t_gbps`` — hashlib sha256 over the same files, one after another, one thread;
* ``verify_blake3_gbps``, ``blake3_1t_gbps``, ``blake3_mt_gbps`` — the same with blake3;
* ``verify_w1_gbps`` — a world-size-1 snapshot, where one DCP file holds
  nearly every byte, so there is nothing to hash in parallel;
* ``verify_cli_s`` — wall time of the ``ckptrun verify SNAPSHOT --json`` command
  (interpreter start-up and imports included), page-cached.

GB is 10^9 bytes.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import (
    CACHED,
    EVICTED,
    Figure,
    MiB,
    evict,
    failed,
    files_under,
    interleave,
    total_bytes,
    warm,
)
from snapshots import Snapshots

CHUNK = 4 * MiB


def hash_files(paths: list[Path], new: Callable[[], Any]) -> float:
    """Seconds to hash ``paths`` one after another on this thread, read in large chunks."""
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    started = time.perf_counter()
    for path in paths:
        hasher = new()
        with open(path, "rb", buffering=0) as stream:
            while count := stream.readinto(buffer):
                hasher.update(view[:count])
        hasher.hexdigest()
    return time.perf_counter() - started


def verify_seconds(path: Path) -> float:
    from ckptrun.runtime.checkpoint.verify import verify_snapshot

    started = time.perf_counter()
    report = verify_snapshot(path)
    seconds = time.perf_counter() - started
    if not report.ok:
        raise RuntimeError(f"{path} does not verify: {report.problems[:2]}")
    return seconds


def cli_seconds(path: Path) -> float:
    command = [str(Path(sys.executable).with_name("ckptrun")), "verify", str(path), "--json"]
    started = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True)
    return time.perf_counter() - started


def _trial(key: str, path: Path, seconds: Callable[[], float], cached: bool) -> Callable[[], dict[str, float]]:
    nbytes = total_bytes(files_under(path))

    def run() -> dict[str, float]:
        (warm if cached else evict)(path)
        return {key: nbytes / seconds() / 1e9}

    return run


def _blake3(threads: int) -> Callable[[], Any]:
    import blake3  # type: ignore[import-not-found]

    return lambda: blake3.blake3(max_threads=threads if threads > 0 else blake3.blake3.AUTO)


def _trials(snaps: Snapshots, blake3: bool) -> dict[str, Callable[[], dict[str, float]]]:
    multi = snaps.w2.get("sha256")
    trials = {}
    if multi is not None:
        files = files_under(multi)
        for cached, suffix in ((True, ""), (False, "_evicted")):
            trials[f"verify{suffix}_gbps"] = _trial(f"verify{suffix}_gbps", multi, lambda: verify_seconds(multi), cached)
            trials[f"sha256_1t{suffix}_gbps"] = _trial(f"sha256_1t{suffix}_gbps", multi, lambda: hash_files(files, hashlib.sha256), cached)
        trials["verify_cli_s"] = lambda: (warm(multi), {"verify_cli_s": cli_seconds(multi)})[1]
    single = snaps.w1["sha256"]
    trials["verify_w1_gbps"] = _trial("verify_w1_gbps", single, lambda: verify_seconds(single), True)
    multi_b3 = snaps.w2.get("blake3")
    if blake3 and multi_b3 is not None:
        files_b3 = files_under(multi_b3)
        trials["verify_blake3_gbps"] = _trial("verify_blake3_gbps", multi_b3, lambda: verify_seconds(multi_b3), True)
        trials["verify_blake3_evicted_gbps"] = _trial("verify_blake3_evicted_gbps", multi_b3, lambda: verify_seconds(multi_b3), False)
        trials["blake3_1t_gbps"] = _trial("blake3_1t_gbps", multi_b3, lambda: hash_files(files_b3, _blake3(1)), True)
        trials["blake3_mt_gbps"] = _trial("blake3_mt_gbps", multi_b3, lambda: hash_files(files_b3, _blake3(0)), True)
    return trials


NOTES = {
    "verify_gbps": "verify_snapshot on the 2-rank snapshot (sha256, files in parallel threads)",
    "sha256_1t_gbps": "hashlib sha256, same files, one thread",
    "verify_w1_gbps": "verify_snapshot on a world-size-1 snapshot (one big DCP file)",
    "verify_cli_s": "`ckptrun verify SNAPSHOT --json` wall time, interpreter start included",
    "blake3_mt_gbps": "blake3 max_threads=AUTO",
}


def measure(snaps: Snapshots, repeats: int, blake3: bool) -> dict[str, Figure]:
    samples = interleave(repeats, _trials(snaps, blake3))
    figures = {}
    for key, values in samples.items():
        world = 1 if key == "verify_w1_gbps" else 2
        cache = EVICTED if "evicted" in key else CACHED
        unit = "s" if key.endswith("_s") else "GB/s"
        figures[key] = Figure(values, unit, cache, world, note=NOTES.get(key.replace("_evicted", ""), ""))
    if snaps.w2_error:
        for key in ("verify_gbps", "sha256_1t_gbps"):
            figures[key] = failed(f"no 2-rank snapshot: {snaps.w2_error}", "GB/s", CACHED, 2)
    return figures
