"""Applying the retention policy to the checkpoint dir: delete only what a newer verified snapshot covers.

The decision is :class:`ckptrun.runtime.checkpoint.policies.Retention` (pure); this module
finds the current lineage's published snapshots, checks the newest before
deleting anything, and deletes through the store. Importable without torch.

The check is manifest + sizes: the digests were taken as the bytes were
written, and re-hashing right after the save would mostly read the page cache
back (double I/O on the writer thread, little proof). ``paranoid`` re-hashes the
newest snapshot after dropping it from the page cache, so the digests are
checked against what the disk returns.

On an object store (:func:`apply_remote_retention`) the same rule holds for
prefixes of the current line: nothing is deleted before the newest manifest
checks out (sizes from the listing; ``paranoid``: every object streamed and
hashed). Prefixes without a manifest older than a few save intervals are
interrupted uploads: removed, with an event. A tiered run's local copies are
a cache of the store and are evicted newest-K-kept (:func:`evict_cache`).
"""

from __future__ import annotations

from pathlib import Path

from ckptrun.runtime import records
from ckptrun.runtime.storage import store
from ckptrun.runtime.checkpoint.policies import Retention
from ckptrun.runtime.storage.remote_store import FsspecStore
from ckptrun.runtime.checkpoint.verify import verify_remote, verify_snapshot

GARBAGE_MIN_AGE_S = 600.0  # a manifest-less prefix younger than this may be an upload in flight
GARBAGE_INTERVALS = 3  # ... or younger than this many save intervals


def apply_retention(ckpt_dir: Path, policy: Retention, run_dir: Path, paranoid: bool = False,
                    remote: FsspecStore | None = None, keep: str | None = None) -> list[int]:
    """Rank 0, after a publish: delete what the policy allows once the newest snapshot checks out.
    With an object store, its prefixes follow the policy and ``ckpt_dir`` is its cache. ``keep``: the last
    good snapshot before the run's first non-finite loss (its name), never deleted."""
    if remote is not None:
        evict_cache(ckpt_dir, policy.keep_last, run_dir)
        return apply_remote_retention(remote, policy, run_dir, paranoid, keep=keep)
    chain = [entry for entry, _ in store.current_lineage(ckpt_dir)]
    doomed = set(policy.to_delete([e.step for e in chain])) - {e.step for e in chain if e.name == keep}
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


def apply_remote_retention(remote: FsspecStore, policy: Retention, run_dir: Path, paranoid: bool = False,
                           now: float | None = None, keep: str | None = None) -> list[int]:
    """Rank 0, after a commit: delete the current line's prefixes the policy allows once the newest
    manifest verifies; remove interrupted uploads. Returns the deleted steps."""
    prefixes = remote.prefixes()
    line = remote.line(prefixes)
    _collect_garbage(remote, prefixes, line, run_dir, now)
    doomed = set(policy.to_delete([p.step for p in line])) - {p.step for p in line if p.name == keep}
    if not doomed:
        return []
    newest = line[-1]
    report = verify_remote(remote, newest.name, quick=not paranoid, prefixes=prefixes)
    if not report.ok:
        records.log_event(run_dir, "retention_skipped", reason=f"{newest.where} does not verify: {'; '.join(report.problems[:3])}")
        return []
    deleted = []
    for item in line[:-1]:
        if item.step in doomed:
            remote.delete(item.name)
            records.log_event(run_dir, "snapshot_deleted", step=item.step, path=item.where)
            deleted.append(item.step)
    return sorted(deleted)


def _collect_garbage(remote: FsspecStore, prefixes: list, line: list, run_dir: Path, now: float | None) -> None:
    """Manifest-less prefixes older than max(10 min, 3 save intervals): interrupted uploads."""
    created = [p.manifest.created for p in line[-2:]]
    interval = created[-1] - created[0] if len(created) == 2 else 0.0
    for name in remote.garbage(max(GARBAGE_MIN_AGE_S, GARBAGE_INTERVALS * interval), now, prefixes):
        records.log_event(run_dir, "garbage_deleted", path=remote.location(name),
                          reason="no manifest: an interrupted upload")


def evict_cache(cache: Path, keep: int, run_dir: Path) -> list[int]:
    """A tiered run's local copies: keep the newest ``keep`` (the store holds every snapshot retention keeps)."""
    entries = [entry for entry, _ in store.published(cache)]
    doomed = sorted(entries, key=lambda e: e.step)[:-max(1, keep)]
    for entry in doomed:
        store.delete_snapshot(entry.path)
        records.log_event(run_dir, "cache_evicted", step=entry.step, path=str(entry.path))
    return [entry.step for entry in doomed]
