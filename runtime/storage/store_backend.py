"""The snapshot store interface, and its local backend.

Two backends keep published snapshots behind one small interface — list the
published ones, open a new one, write its files, publish it, read, delete:

* :class:`LocalStore` — a directory with temp dir, fsync and rename (the
  functions of :mod:`store`, unchanged). The local cache of a tiered run is a
  LocalStore (the memory tier's ``/dev/shm`` directory follows the same
  protocol, written through :mod:`store` by a Saver of its own).
* :class:`ckptrun.runtime.storage.remote_store.FsspecStore` — an object store, where
  each snapshot is an immutable prefix and the manifest written last commits it.

:mod:`transfer` copies a snapshot from any store to any other through this
interface, hashing every byte against the manifest. Two copies of one
snapshot are the same when their manifests are (:func:`manifest_digest`).
Importable without torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator, Protocol

from ckptrun.runtime.storage import store
from ckptrun.runtime.manifest import Manifest, read_manifest


def manifest_digest(manifest: Manifest) -> str:
    """One digest naming a snapshot's content: equal manifests list equal bytes."""
    return hashlib.sha256(manifest.to_json().encode()).hexdigest()


@dataclass(frozen=True)
class Published:
    """A published snapshot of some store: its name there, its manifest, where it lives (for messages)."""

    name: str
    step: int
    manifest: Manifest
    where: str

    @property
    def digest(self) -> str:
        return manifest_digest(self.manifest)


class SnapshotStore(Protocol):
    """What ckptrun needs of a place that keeps snapshots."""

    where: str

    def published(self) -> list[Published]:
        """Snapshots whose manifest reads, oldest step first (every line): of the run the store is bound to
        (``run_id``), or of every run when it is bound to none."""

    def open_new(self, step: int) -> str:
        """A handle for a snapshot being written: invisible until :meth:`publish`."""

    def open_write(self, handle: str, relpath: str) -> contextlib.AbstractContextManager[BinaryIO]:
        """A stream for one file of the new snapshot; durable once the context exits."""

    def publish(self, handle: str, manifest: Manifest) -> Published:
        """Make the written snapshot visible, atomically, with ``manifest`` as its commit."""

    def discard(self, handle: str) -> None:
        """Forget an unpublished snapshot."""

    def open_read(self, name: str, relpath: str) -> contextlib.AbstractContextManager[BinaryIO]:
        """A stream over one file of a published snapshot."""

    def delete(self, name: str) -> None:
        """Delete a published snapshot; never seen half-deleted."""


class LocalStore:
    """A checkpoint directory on a POSIX file system (see :mod:`store` for the commit protocol).

    ``run_id``: list only that run's snapshots (a directory two runs wrote into by mistake never hands one
    the other's); None lists every run's, as a cache whose copies are matched by manifest digest does."""

    def __init__(self, root: Path, run_id: str | None = None) -> None:
        self.root, self.run_id = Path(root), run_id
        self.where = str(self.root)

    def path(self, name: str) -> Path:
        return self.root / name

    def published(self) -> list[Published]:
        return [Published(entry.name, entry.step, manifest, str(entry.path)) for entry, manifest in store.published(self.root)
                if self.run_id is None or manifest.run_id == self.run_id]

    def open_new(self, step: int) -> str:
        return store.new_temp_dir(self.root, step).name

    @contextlib.contextmanager
    def open_write(self, handle: str, relpath: str) -> Iterator[BinaryIO]:
        path = self.root / handle / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as stream:
            yield stream
            stream.flush()
            os.fsync(stream.fileno())

    def publish(self, handle: str, manifest: Manifest) -> Published:
        temp = self.root / handle
        for sub in {Path(f.path).parent for f in manifest.files if "/" in f.path}:
            store.fsync_dir(temp / sub)
        store.write_manifest(temp, manifest)
        final = store.publish(temp, manifest.step)
        return Published(final.name, manifest.step, read_manifest(final), str(final))

    def discard(self, handle: str) -> None:
        shutil.rmtree(self.root / handle, ignore_errors=True)

    @contextlib.contextmanager
    def open_read(self, name: str, relpath: str) -> Iterator[BinaryIO]:
        with open(self.root / name / relpath, "rb") as stream:
            yield stream

    def delete(self, name: str) -> None:
        store.delete_snapshot(self.root / name)

    def find(self, digest: str) -> Published | None:
        """The published copy of the snapshot whose manifest digest is ``digest``, if this store holds one."""
        return next((p for p in reversed(self.published()) if p.digest == digest), None)
