"""A save until it is durable: ckptrun's sync path against torch.save, DCP and the raw disk.

Per repeat, interleaved, the same model + AdamW state (world size 1):

* ``save_total_s`` — state built as ``Run.save`` does, ``Saver.begin`` on the
  sync path until published: DCP tensor file hashed (sha256) while written,
  fsync, JSON + RNG files, manifest, rename, directory fsyncs;
* ``save_total_blake3_s`` — the same with blake3 digests;
* ``torch_save_s`` — ``torch.save`` of the model and optimizer state_dicts + fsync;
* ``dcp_save_s`` — ``dcp.save`` of the same state_dicts (FileSystemWriter defaults, fsync on);
* ``raw_write_s`` — the state's tensor bytes written sequentially to one file + fsync.

Every figure includes its fsync, so page-cache write bursts do not flatter any
of them; the disk's sustained write speed is bimodal on these machines, which
is why the variants are interleaved.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from common import WRITTEN, BigState, Figure, interleave, save_once, settle, write_fsync


def _ckptrun_trial(state: BigState, ckpt_dir: Path, algorithm: str) -> Callable[[], float]:
    from ckptrun.runtime.checkpoint.saver import Saver

    saver = Saver(ckpt_dir, algorithm, asynchronous=False)
    save_once(saver, state)  # staging buffers are allocated once per run
    settle(saver)

    def run() -> float:
        started = time.perf_counter()
        save_once(saver, state)
        result = saver.collect(wait=True)[-1]
        seconds = time.perf_counter() - started
        if not result.ok:
            raise RuntimeError(f"ckptrun sync save failed: {result.error}")
        from ckptrun.runtime.storage import store

        store.delete_snapshot(result.path)
        return seconds

    return run


def _torch_save(state: BigState, path: Path) -> float:
    import torch

    started = time.perf_counter()
    write_fsync(path, lambda stream: torch.save(state.natural_state_dict(), stream))
    seconds = time.perf_counter() - started
    path.unlink()
    return seconds


def _dcp_save(state: BigState, path: Path) -> float:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    started = time.perf_counter()
    dcp.save(state.natural_state_dict(), storage_writer=FileSystemWriter(path))
    seconds = time.perf_counter() - started
    shutil.rmtree(path)
    return seconds


def _raw_write(state: BigState, path: Path) -> float:
    tensors = list(state.collect().shared_tensors.values())
    started = time.perf_counter()
    with open(path, "wb", buffering=0) as stream:
        stream.writelines(tensor.numpy().data.cast("B") for tensor in tensors)
        os.fsync(stream.fileno())
    seconds = time.perf_counter() - started
    path.unlink()
    return seconds


def measure(state: BigState, scratch: Path, repeats: int, blake3: bool) -> dict[str, Figure]:
    scratch.mkdir(parents=True, exist_ok=True)
    trials = {
        "save_total_s": _ckptrun_trial(state, scratch / "ckptrun-sync", "sha256"),
        "torch_save_s": lambda: _torch_save(state, scratch / "torch.pt"),
        "dcp_save_s": lambda: _dcp_save(state, scratch / "dcp-sync"),
        "raw_write_s": lambda: _raw_write(state, scratch / "raw.bin"),
    }
    if blake3:
        trials["save_total_blake3_s"] = _ckptrun_trial(state, scratch / "ckptrun-sync-b3", "blake3")
    samples = interleave(repeats, {key: (lambda fn=fn, key=key: {key: fn()}) for key, fn in trials.items()})
    notes = {"save_total_s": "sync path until published, sha256 while writing, fsyncs included",
             "save_total_blake3_s": "as save_total_s with blake3 digests",
             "torch_save_s": "torch.save(model+optimizer state_dicts) + fsync",
             "dcp_save_s": "dcp.save, FileSystemWriter defaults (one file, fsync)",
             "raw_write_s": f"{state.tensors_bytes} tensor bytes, one file, sequential, fsync"}
    return {key: Figure(values, "s", WRITTEN, note=notes[key]) for key, values in samples.items()}
