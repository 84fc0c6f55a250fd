"""The upload phase of a save to an object store: every rank uploads what it wrote, rank 0 commits.

Runs on the background writer right after the local publish (see
:mod:`remote_store` for why the snapshot is written locally first). Rank 0
names the immutable prefix ``step-<N>-<id>/`` and shares the manifest; each
rank streams the files the manifest says it wrote (``FileEntry.rank``),
hashing them against their digests, retried with back-off; the ranks agree on
the outcome over the snapshot group; then rank 0 writes ``manifest.json``
last: the commit. Any failure discards the prefix and the local copy and
makes the save a failed save (the failed-save stop applies; training goes on).
A kill at any moment before the commit leaves a prefix without a manifest,
which does not exist for restore and is collected later as garbage.

Without ``--local-cache`` the local directory is staging only: once the
commit is written its snapshots are deleted (the store holds them). On many
nodes ``--local-cache`` is each node's own: every rank copies its files there
as it uploads them (:mod:`node_cache`), published once the commit is known.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from ckptrun.runtime import collectives
from ckptrun.runtime.storage import store
from ckptrun.runtime.manifest import Manifest, read_manifest
from ckptrun.runtime.storage.remote_store import FsspecStore
from ckptrun.runtime.checkpoint.node_cache import NodeCache
from ckptrun.runtime.checkpoint.snapshot import SaveResult
from ckptrun.runtime.storage.store_backend import LocalStore
from ckptrun.runtime.storage.transfer import Retry, copy_files, describe

UPLOAD_THREADS = 4


def _log(line: str) -> None:
    print(f"ckptrun: {line}", file=sys.stderr, flush=True)


def upload(result: SaveResult, temp_dir: Path, remote: FsspecStore, keep_local: bool, fault: Callable[[str], None],
           group: Any = None, retry: Retry = Retry(), cache: NodeCache | None = None) -> SaveResult:
    """Upload a locally published snapshot and commit it; every rank gets the same result. ``cache`` (many
    nodes, ``--local-cache``): each rank keeps its own files in its node's cache too."""
    started = time.monotonic()
    rank = collectives.rank()
    shared = (remote.open_new(result.step), read_manifest(result.path).to_json()) if rank == 0 else None  # type: ignore[arg-type]
    name, text = collectives.broadcast_object(shared, group=group)
    manifest = Manifest.model_validate_json(text)
    error = _upload_own(result.path, temp_dir, remote, name, manifest, rank, fault, retry, cache)  # type: ignore[arg-type]
    errors = [e for e in collectives.all_gather_object(error, group=group) if e]
    if not errors:
        fault("before-commit")
    verdict = _commit(result.path, remote, name, manifest, keep_local, errors, retry) if rank == 0 else None  # type: ignore[arg-type]
    verdict = collectives.broadcast_object(verdict, group=group)
    if cache is not None:
        _best_effort(lambda: cache.settle(name, manifest, committed=verdict is None))
    seconds = time.monotonic() - started
    if verdict is not None:
        return replace(result, ok=False, error=verdict, path=None, upload_s=seconds)
    return replace(result, remote=remote.location(name), upload_s=seconds)


def _upload_own(published: Path, temp_dir: Path, remote: FsspecStore, name: str, manifest: Manifest, rank: int,
                fault: Callable[[str], None], retry: Retry, cache: NodeCache | None) -> str | None:
    """Stream this rank's files (from the published directory, or the temp dir on a node that did not publish),
    and copy them into the node's cache (a copy that fails costs the cache that snapshot, not the save)."""
    mine = [entry for entry in manifest.files if (entry.rank or 0) == rank]
    source = published if all((published / e.path).exists() for e in mine) else temp_dir
    try:
        fault("upload")
        copy_files(LocalStore(source.parent), source.name, remote, name, mine, retry, UPLOAD_THREADS, _log)
    except Exception as exc:  # noqa: BLE001 - any storage failure is this save's failure
        return f"rank {rank}: uploading {store.snapshot_name(manifest.step)} to {remote.location(name)} failed: {describe(exc)}"
    if cache is not None:
        _best_effort(lambda: cache.keep_own(source, name, mine))
    return None


def _commit(published: Path, remote: FsspecStore, name: str, manifest: Manifest, keep_local: bool,
            errors: list[str], retry: Retry) -> str | None:
    """Rank 0: the manifest last, or clean up after a failure; None when committed, else the error."""
    if not errors:
        try:
            retry.run(lambda: remote.publish(name, manifest), f"committing {remote.location(name)}", _log)
        except Exception as exc:  # noqa: BLE001
            errors = [f"committing {remote.location(name)} failed: {describe(exc)}"]
    if errors:
        _best_effort(lambda: remote.discard(name))
        _best_effort(lambda: store.delete_snapshot(published))  # a local copy the store does not hold is never restored
        return "; ".join(errors)
    if not keep_local:
        evict_staging(published.parent)
    return None


def evict_staging(staging: Path) -> None:
    """Delete every snapshot of a staging directory: the store holds them now."""
    for entry in store.list_entries(staging, include_abandoned=False):
        if entry.kind == "published":
            _best_effort(lambda: store.delete_snapshot(entry.path))
    store.clean_temp_dirs(staging)


def _best_effort(action: Callable[[], Any]) -> None:
    try:
        action()
    except Exception as exc:  # noqa: BLE001 - cleanup must not hide the real outcome
        _log(f"cleanup failed: {describe(exc)}")
