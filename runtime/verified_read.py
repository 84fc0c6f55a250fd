"""Reading snapshot bytes once and checking them against the manifest as they are read.

The load side of chunk digests (see :mod:`hashing`): a loader reads each byte it
needs into memory once and hashes those same bytes — a small file whole, a DCP
item by the manifest's chunks for exactly its byte range — before anything is
parsed from them. Items are hashed on helper threads while the next one is
read, so verifying costs about what the read costs, not a second pass.
Importable without torch.
"""

from __future__ import annotations

import io
import mmap
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from ckptrun.runtime.hashing import entry_hasher, new_hasher
from ckptrun.runtime.manifest import Chunk, FileEntry

WINDOW_BYTES = 256 << 20  # read ahead of the item being parsed by at most this much (and HASH_THREADS + 1 items)
HASH_THREADS = max(1, min(4, os.cpu_count() or 1))
_MAX_READ = 0x7FFFF000  # Linux moves at most this many bytes per read(2)


class DigestMismatch(ValueError):
    """Bytes read differ from what the manifest records (or the manifest has no digest for them)."""


def read_small(root: Path, entry: FileEntry, verify: bool) -> bytes:
    """A small listed file's bytes, read once and, with ``verify``, checked against its manifest digest."""
    data = (root / entry.path).read_bytes()
    if len(data) != entry.size:
        raise DigestMismatch(f"{entry.path}: {len(data)} bytes, manifest says {entry.size}")
    if verify:
        hasher = entry_hasher(entry)
        hasher.update(data)
        if hasher.hexdigest() != entry.digest:
            raise DigestMismatch(f"{entry.path}: {entry.algorithm} {hasher.hexdigest()[:16]}…, "
                                 f"manifest says {entry.digest[:16]}…")
    return data


@dataclass(frozen=True)
class Span:
    """One byte range a loader reads from a file, and what it holds (for messages)."""

    offset: int
    length: int
    what: str


class ChunkIndex:
    """A chunked file's chunks by offset: which of them tile a byte range exactly."""

    def __init__(self, entry: FileEntry) -> None:
        self.entry = entry
        self.chunks = list(entry.chunks or [])
        self.at = {chunk.offset: index for index, chunk in enumerate(self.chunks)}

    def covering(self, span: Span) -> list[Chunk]:
        index, end, found = self.at.get(span.offset), span.offset + span.length, []
        while index is not None and index < len(self.chunks) and self.chunks[index].offset < end:
            found.append(self.chunks[index])
            index += 1
        if not found or found[-1].offset + found[-1].length != end:
            raise DigestMismatch(f"{self.entry.path}: the manifest has no chunk digest for bytes "
                                 f"{span.offset}..{end} ({span.what})")
        return found

    def check(self, span: Span, data: Any) -> str | None:
        """A problem with ``data`` (the bytes of ``span``), or None when every covering chunk matches."""
        try:
            chunks = self.covering(span)
        except DigestMismatch as exc:
            return str(exc)
        view = memoryview(data).cast("B")
        for chunk in chunks:
            hasher = new_hasher(self.entry.algorithm)
            hasher.update(view[chunk.offset - span.offset:chunk.offset - span.offset + chunk.length])
            if hasher.hexdigest() != chunk.digest:
                return (f"{self.entry.path} bytes {chunk.offset}..{chunk.offset + chunk.length} ({span.what}): "
                        f"{self.entry.algorithm} {hasher.hexdigest()[:16]}…, manifest says {chunk.digest[:16]}…")
        return None


def read_spans(path: Path, spans: list[Span], index: ChunkIndex | None) -> Iterator[tuple[Span, memoryview]]:
    """Each span's bytes, in the order given, read once; with ``index`` each is yielded only after its
    chunks matched (else :class:`DigestMismatch`). Later spans are read while earlier ones hash."""
    pending: deque[tuple[Span, memoryview, Future | None]] = deque()
    held = 0
    with open(path, "rb", buffering=0) as stream, ThreadPoolExecutor(HASH_THREADS, "ckptrun-verify") as pool:
        for span in spans:
            data = _read_at(stream.fileno(), span, path.name)
            pending.append((span, data, pool.submit(index.check, span, data) if index is not None else None))
            held += span.length
            while pending and (held > WINDOW_BYTES or len(pending) > HASH_THREADS):
                held -= pending[0][0].length
                yield _checked(*pending.popleft())
        while pending:
            yield _checked(*pending.popleft())


def _checked(span: Span, data: memoryview, check: Future | None) -> tuple[Span, memoryview]:
    problem = check.result() if check is not None else None
    if problem:
        raise DigestMismatch(problem)
    return span, data


def _read_at(fd: int, span: Span, name: str) -> memoryview:
    """``span``'s bytes in fresh memory (a large buffer is an anonymous mapping: nothing zero-filled first)."""
    buffer: Any = mmap.mmap(-1, span.length) if span.length >= 1 << 20 else bytearray(span.length)
    view, done = memoryview(buffer), 0
    while done < span.length:
        count = os.preadv(fd, [view[done:done + _MAX_READ]], span.offset + done)
        if count == 0:
            raise DigestMismatch(f"{name} ends {span.length - done} bytes before the end of {span.what}")
        done += count
    return view


class MemoryFile(io.RawIOBase):
    """A read-only, seekable file over bytes already in memory, without copying them (``io.BytesIO``
    copies): what ``torch.load`` deserialises a verified item from."""

    def __init__(self, data: memoryview) -> None:
        super().__init__()
        self.data, self.position = data.cast("B"), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        count = max(0, min(len(buffer), len(self.data) - self.position))
        memoryview(buffer).cast("B")[:count] = self.data[self.position:self.position + count]
        self.position += count
        return count

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: len(self.data)}[whence]
        self.position = max(0, base + offset)
        return self.position

    def tell(self) -> int:
        return self.position
