"""Applying the retention policy to the checkpoint dir: delete only what a newer verified snapshot covers.

The decision is :class:`ckptrun.runtime.policies.Retention` (pure); this module
finds the current lineage's published snapshots, checks the newest before
deleting anything, and deletes through the store. Importable without torch.

The check is manifest + sizes: the digests were taken as the bytes were
written, and re-hashing right after the save would mostly read the page cache
back (double I/O on the writer thread, little proof). ``paranoid`` re-hashes the
newest snapshot after dropping it from the page cache, so the digests are
checked against what the disk returns.
"""

from __future__ import annotations

from pathlib import Path

from ckptrun.runtime import records, store
from ckptrun.runtime.policies import Retention
from ckptrun.runtime.verify import verify_snapshot


def apply_retention(ckpt_dir: Path, policy: Retention, run_dir: Path, paranoid: bool = False) -> list[int]:
    """Rank 0, after a publish: delete what the policy allows once the newest snapshot checks out."""
    chain = [entry for entry, _ in store.current_lineage(ckpt_dir)]
    doomed = set(policy.to_delete([e.step for e in chain]))
    if not doomed:
        return []
    newest = max(chain, key=lambda e: e.step)
    report = verify_snapshot(newest.path, quick=not paranoid, uncached=paranoid)
    if not report.ok:
        records.log_event(run_dir, "retention_skipped", reason=f"{newest.name} does not verify: {'; '.join(report.problems[:3])}")
        return []
    for entry in chain:
        if entry.step in doomed:
            store.delete_snapshot(entry.path)
            records.log_event(run_dir, "snapshot_deleted", step=entry.step, path=str(entry.path))
    return sorted(doomed)
