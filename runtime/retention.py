"""Applying the retention policy to the checkpoint dir: delete only what a newer verified snapshot covers.

The decision is :class:`ckptrun.runtime.policies.Retention` (pure); this module
finds the current lineage's published snapshots, verifies the newest before
deleting anything, and deletes through the store. Importable without torch.
"""

from __future__ import annotations

from pathlib import Path

from ckptrun.runtime import records, store
from ckptrun.runtime.policies import Retention
from ckptrun.runtime.verify import verify_snapshot


def apply_retention(ckpt_dir: Path, policy: Retention, run_dir: Path) -> list[int]:
    """Rank 0, after a publish: delete what the policy allows once the newest snapshot verifies."""
    chain = [entry for entry, _ in store.current_lineage(ckpt_dir)]
    doomed = set(policy.to_delete([e.step for e in chain]))
    if not doomed:
        return []
    newest = max(chain, key=lambda e: e.step)
    if not verify_snapshot(newest.path).ok:
        records.log_event(run_dir, "retention_skipped", reason=f"{newest.name} does not verify")
        return []
    for entry in chain:
        if entry.step in doomed:
            store.delete_snapshot(entry.path)
            records.log_event(run_dir, "snapshot_deleted", step=entry.step, path=str(entry.path))
    return sorted(doomed)
