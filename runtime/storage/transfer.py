"""Copying snapshots between stores with every byte hashed on the way, and retries with back-off.

An upload hashes what it reads from the local snapshot as it streams it and
checks the digest equals the manifest's: what lands in the store is what was
verified locally. A download hashes what the store returns and refuses the
snapshot on any difference in size or digest — an object changed after its
manifest was written is caught here, not by ``dcp.load`` (which loads a
flipped byte silently). Storage errors (unreachable, throttled, expired
credentials) are retried with exponential back-off; a digest mismatch is
not: the same bytes would come back. Importable without torch.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, TypeVar

from ckptrun.runtime.hashing import CHUNK, entry_hasher
from ckptrun.runtime.manifest import FileEntry, Manifest
from ckptrun.runtime.storage.store_backend import Published, SnapshotStore

T = TypeVar("T")


class MismatchError(ValueError):
    """The bytes copied differ from the manifest (size or digest): the source snapshot is refused."""


class StoreUnavailable(RuntimeError):
    """The store failed after every retry (unreachable, denied, throttled): which snapshot is newest, or its
    bytes, are unknown now — not absent. Whoever restores gives up resumably rather than start from step 0."""


@dataclass(frozen=True)
class Retry:
    """``attempts`` tries with back-off ``base`` · 2^k seconds between them, at most ``cap``."""

    attempts: int = 4
    base: float = 0.5
    cap: float = 8.0

    def run(self, action: Callable[[], T], what: str, log: Callable[[str], None] = lambda _: None) -> T:
        """Run ``action``; retry storage errors, never a :class:`MismatchError` or a ``TypeError`` (a storage
        option the filesystem does not take fails the same way every time); the last error propagates."""
        for attempt in range(1, self.attempts + 1):
            try:
                return action()
            except (MismatchError, TypeError):
                raise
            except Exception as exc:  # noqa: BLE001 - storage libraries raise anything; the last one propagates
                if attempt == self.attempts:
                    raise
                delay = min(self.cap, self.base * 2 ** (attempt - 1))
                log(f"{what} failed ({describe(exc)}); retry {attempt}/{self.attempts - 1} in {delay:g}s")
                time.sleep(delay)
        raise AssertionError("unreachable")


def describe(exc: BaseException) -> str:
    """One line naming a storage error."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def copy_file(source: SnapshotStore, name: str, target: SnapshotStore, handle: str, entry: FileEntry,
              progress: Callable[[int], None] | None = None) -> None:
    """Stream one listed file from ``source`` to ``target``, hashing; :class:`MismatchError` unless it matches."""
    hasher, size = entry_hasher(entry), 0
    with source.open_read(name, entry.path) as reader, target.open_write(handle, entry.path) as writer:
        while True:
            chunk = reader.read(CHUNK)
            if not chunk:
                break
            hasher.update(chunk)
            writer.write(chunk)
            size += len(chunk)
            if progress is not None:
                progress(len(chunk))
            if size > entry.size:
                break
    check(f"{source.where}/{name}/{entry.path}", entry, size, hasher.hexdigest())


def hash_object(source: SnapshotStore, name: str, entry: FileEntry, progress: Callable[[int], None] | None = None) -> tuple[int, str]:
    """Size and manifest digest (:func:`hashing.entry_hasher`) of one stored file, read in streaming chunks
    (``verify`` on an object store)."""
    hasher, size = entry_hasher(entry), 0
    with source.open_read(name, entry.path) as reader:
        while chunk := reader.read(CHUNK):
            hasher.update(chunk)
            size += len(chunk)
            if progress is not None:
                progress(len(chunk))
    return size, hasher.hexdigest()


def check(where: str, entry: FileEntry, size: int, digest: str) -> None:
    if size != entry.size:
        raise MismatchError(f"{where}: {size if size <= entry.size else 'more than ' + str(entry.size)} bytes, manifest says {entry.size}")
    if digest != entry.digest:
        raise MismatchError(f"{where}: {entry.algorithm} {digest[:16]}…, manifest says {entry.digest[:16]}…")


def copy_files(source: SnapshotStore, name: str, target: SnapshotStore, handle: str, entries: Iterable[FileEntry],
               retry: Retry, threads: int = 4, log: Callable[[str], None] = lambda _: None,
               progress: Callable[[int], None] | None = None) -> None:
    """Copy ``entries`` in parallel streams (object stores reward concurrency), each retried on its own."""
    def one(entry: FileEntry) -> None:
        retry.run(lambda: copy_file(source, name, target, handle, entry, progress), f"copying {entry.path}", log)

    with ThreadPoolExecutor(max(1, threads)) as pool:
        for future in [pool.submit(one, entry) for entry in entries]:
            future.result()


def copy_snapshot(source: SnapshotStore, snapshot: Published, target: SnapshotStore, retry: Retry = Retry(),
                  threads: int = 4, log: Callable[[str], None] = lambda _: None,
                  progress: Callable[[int], None] | None = None) -> Published:
    """Copy a whole published snapshot and publish it in ``target`` (manifest last); nothing is published
    in ``target`` unless every file matched. Raises :class:`MismatchError` or the storage error."""
    manifest: Manifest = snapshot.manifest
    handle = target.open_new(manifest.step)
    try:
        copy_files(source, snapshot.name, target, handle, manifest.files, retry, threads, log, progress)
        return retry.run(lambda: target.publish(handle, manifest), f"publishing {snapshot.name}", log)
    except BaseException:
        target.discard(handle)
        raise
