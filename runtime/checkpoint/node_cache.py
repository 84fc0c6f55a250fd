"""A node's own share of each durable snapshot, kept on its disk: ``--local-cache`` on many nodes.

On one node ``--local-cache`` is the run's local snapshot directory. On many
nodes a snapshot stages in the shared ``RUN_DIR/staging`` while it uploads, and
one node's directory would miss the other nodes' files, so each rank copies the
files it wrote (``FileEntry.rank``) into its node's cache as it uploads them
(:meth:`NodeCache.keep_own`). Once the store has committed the snapshot, the
node's first rank (``LOCAL_RANK`` 0; every rank of the node copied before the
ranks agreed on the upload) writes the whole manifest beside them and publishes
the directory (:meth:`NodeCache.settle`): a copy that holds this node's files of
a snapshot whose manifest lists every file, kept newest-K. A restart fills such
a copy with the files it lacks from the store, every byte hashed as it streams
(:func:`fill`, from :func:`ckptrun.runtime.checkpoint.tiering.choose`), and loads
it: each node reads its own shards from its own disk and downloads the rest.
Importable without torch.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from ckptrun.runtime.manifest import FileEntry, Manifest
from ckptrun.runtime.storage import store
from ckptrun.runtime.storage.store_backend import LocalStore, Published, SnapshotStore
from ckptrun.runtime.storage.transfer import Retry, copy_files

SUFFIX = ".node-cache"  # a copy in progress: ``.<store prefix name>.node-cache``, published once committed


@dataclass(frozen=True)
class NodeCache:
    """This node's cache directory, how many copies it keeps, and whether this rank settles it."""

    root: Path
    keep: int
    run_dir: Path
    first_on_node: bool

    @classmethod
    def for_rank(cls, root: Path | None, keep: int, run_dir: Path) -> "NodeCache | None":
        return cls(Path(root), keep, run_dir, os.environ.get("LOCAL_RANK", "0") == "0") if root is not None else None

    def _pending(self, name: str) -> Path:
        return self.root / f".{name}{SUFFIX}"

    def keep_own(self, source: Path, name: str, entries: Iterable[FileEntry]) -> None:
        """Copy this rank's files of the snapshot being uploaded as ``name`` from ``source`` (not published yet)."""
        target = self._pending(name)
        for entry in entries:
            path = target / entry.path
            path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / entry.path, path)

    def settle(self, name: str, manifest: Manifest, committed: bool) -> Path | None:
        """The node's first rank, once the store's verdict is known: publish the copy (the manifest last) or drop
        it; then keep the newest ``keep`` copies and drop copies of older saves left by a kill. Returns the copy."""
        if not self.first_on_node:
            return None
        pending, final = self._pending(name), None
        if committed and pending.is_dir():
            store.write_manifest(pending, manifest)
            final = store.publish(pending, manifest.step)
        else:
            shutil.rmtree(pending, ignore_errors=True)
        for stale in self.root.glob(f".step-*{SUFFIX}"):
            if _step_of(stale) < manifest.step:
                shutil.rmtree(stale, ignore_errors=True)
        from ckptrun.runtime.checkpoint.retention import evict_cache

        evict_cache(self.root, self.keep, self.run_dir)
        return final


def _step_of(pending: Path) -> int:
    """The step in ``.step-000000016-<id>.node-cache``; a name that does not parse counts as step 0."""
    try:
        return int(pending.name[1:].split("-")[1])
    except (IndexError, ValueError):
        return 0


def absent(copy: Path, manifest: Manifest) -> list[FileEntry]:
    """The files of ``manifest`` a copy lacks or holds at another size (a node's cache holds its own ranks')."""
    missing = []
    for entry in manifest.files:
        try:
            if (copy / entry.path).stat().st_size == entry.size:
                continue
        except OSError:
            pass
        missing.append(entry)
    return missing


def fill(remote: SnapshotStore, snapshot: Published, copy: Path, missing: list[FileEntry], retry: Retry = Retry(),
         threads: int = 4, log: Callable[[str], None] = lambda _: None) -> int:
    """Download ``missing`` into ``copy``, hashed as they stream, moved in only once every one matched
    (:class:`~ckptrun.runtime.storage.transfer.MismatchError` otherwise); returns the bytes downloaded."""
    local = LocalStore(copy.parent)
    handle = local.open_new(snapshot.step)
    try:
        copy_files(remote, snapshot.name, local, handle, missing, retry, threads, log)
        for entry in missing:
            (copy / entry.path).parent.mkdir(parents=True, exist_ok=True)
            os.replace(local.path(handle) / entry.path, copy / entry.path)
    finally:
        local.discard(handle)
    return sum(entry.size for entry in missing)
