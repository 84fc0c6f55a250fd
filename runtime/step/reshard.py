"""Resuming at another world size: allowed only when asked, reseeded, recorded.

Tensors reshard through DCP (replicated ones load at any world size, FSDP2
shards are re-split by ``set_state_dict``) and the data position is one global
cursor (:mod:`ckptrun.runtime.step.data`), so what cannot carry over is per-rank: the
RNG states. A resharded rank is reseeded from ``(seed, step, rank)`` —
deterministic, but not the stream the old ranks would have drawn — so such a
resume is never judged ``exact``. Each change is kept in the manifest's
``world_size_history`` and logged as a ``resharded`` event.
"""

from __future__ import annotations

import sys
from typing import Any

from ckptrun.runtime import records
from ckptrun.runtime.step import rng
from ckptrun.runtime.manifest import Manifest

RESEEDED = ["python", "numpy", "torch_cpu", "torch_cuda"]

ALLOW = ("allow resharding with --allow-reshard (CKPTRUN_ALLOW_RESHARD=1 under plain torchrun): tensors and the data "
         "position carry over, per-rank RNG is reseeded, the resume is no longer bitwise exact")


def history(manifest: Manifest | None, world_size: int, step: int) -> list[dict[str, int]]:
    """The lineage's world sizes as ``[{step, world_size}]``, each entry the step from which it ran at that size."""
    past = list(manifest.world_size_history) if manifest is not None else []
    if manifest is not None and not past:  # written before the history was recorded: one size all along
        past = [{"step": 0, "world_size": manifest.world_size}]
    if not past or past[-1]["world_size"] != world_size:
        past.append({"step": step, "world_size": world_size})
    return past


def refusal(manifest: Manifest, world_size: int) -> str:
    """Why a resume at another world size stops, and how to allow it (one line)."""
    return (f"snapshot step {manifest.step} was written by {manifest.world_size} ranks but this run has {world_size}; "
            f"resume with --nproc-per-node {manifest.world_size}, or {ALLOW}")


def reseed(seed: int, step: int, rank: int) -> None:
    """Every generator of this rank from ``(seed, step, rank)``: the same on a rerun, different per rank and step."""
    rng.seed_everything((seed * 1_000_003 + step) * 65_537 + rank)


def record(run: Any, manifest: Manifest) -> None:
    """The ``resharded`` event and a line for a person (rank 0)."""
    if run.rank != 0:
        return
    records.log_event(run.run_dir, "resharded", attempt=run.env.attempt, step=manifest.step,
                      old_world_size=manifest.world_size, new_world_size=run.world_size, reseeded=RESEEDED,
                      reseeded_from="(seed, step, rank)", exact=False)
    print(f"ckptrun: resharded snapshot step {manifest.step} from {manifest.world_size} to {run.world_size} ranks; "
          "per-rank RNG reseeded from (seed, step, rank): this resume is not bitwise exact", file=sys.stderr, flush=True)


def note_global_batch(run: Any, loader: Any) -> None:
    """A restored cursor whose global batch differs from what this run's first step consumed: say so once
    (event + warning). Judged from the samples the step took (:attr:`DataLoader.step_samples`), so a
    script that accumulates in its own loop is judged by what it trains with, not by ``run.batches``' figure."""
    saved, now = loader.saved_global_batch, loader.step_samples or loader.global_batch
    loader.saved_global_batch = None
    if saved is None or saved == now or run.rank != 0:
        return
    records.log_event(run.run_dir, "global_batch_changed", step=run.step, old_global_batch=saved,
                      new_global_batch=now, world_size=run.world_size)
    print(f"ckptrun: warning: the global batch changed from {saved} to {now} samples per optimizer step at step "
          f"{run.step} (world size {run.world_size}); consume {saved} samples per step to keep it "
          f"(run.batches(..., global_batch={saved}))", file=sys.stderr, flush=True)
