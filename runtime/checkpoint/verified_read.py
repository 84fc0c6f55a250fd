"""Reading snapshot bytes once and checking them against the manifest as they are read.

The load side of chunk digests (see :mod:`hashing`): a loader reads each byte it
needs into memory once and hashes those same bytes — a small file whole, a DCP
item by the manifest's chunks for exactly its byte range — before anything is
parsed from them. Helper threads read an item in pieces of whole chunks and hash
each piece as soon as it is in memory (a large item is cut into several chunks
when written, so its pieces hash on every helper at once) while the caller
parses the items before it: verifying costs about what the read costs.
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
from typing import Any, Callable, Iterator

from ckptrun.runtime.hashing import SUB_CHUNK, entry_hasher, new_hasher
from ckptrun.runtime.manifest import Chunk, FileEntry

WINDOW_BYTES = 256 << 20  # read ahead of the item being parsed by at most this much (and WINDOW_SPANS items)
WINDOW_SPANS = 16
HASH_THREADS = max(2, min(4, os.cpu_count() or 1))  # each reads a piece, then hashes it (both release the GIL)
PIECE = SUB_CHUNK  # a helper's unit of work: whole chunks adding up to about this many bytes
SMALL = 64 << 10  # a chunk this small (an item's tail) joins the piece before it rather than make its own
_MAX_READ = 0x7FFFF000  # Linux moves at most this many bytes per read(2)


class DigestMismatch(ValueError):
    """Bytes read differ from what the manifest records (or the manifest has no digest for them)."""


def prefetch(paths: list[Path]) -> None:
    """Ask the kernel to start reading these (small) files from disk at once, rather than one after another
    as a loader reaches them."""
    if not hasattr(os, "posix_fadvise"):
        return
    for path in paths:
        with open(path, "rb", buffering=0) as stream:
            os.posix_fadvise(stream.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)


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


def read_spans(path: Path, spans: list[Span], index: ChunkIndex | None,
               allocate: Callable[[Span], memoryview] | None = None) -> Iterator[tuple[Span, memoryview]]:
    """Each span's bytes, in the order given, read once; with ``index`` each is yielded only after its
    chunks matched (else :class:`DigestMismatch`).

    A span is cut into pieces of whole chunks (about :data:`PIECE` bytes each); helper threads read each
    piece into its place in the span's buffer and hash it right away, while the caller parses earlier
    spans — so a large item is read and hashed on every helper at once, and reading, hashing and parsing
    overlap. The kernel is asked to fetch each span from disk as soon as it is queued. ``allocate``
    gives a span's buffer — the memory it is finally meant for, where it can (default: an anonymous
    mapping, nothing zero-filled first).
    """
    allocate = allocate or (lambda span: _anonymous(span.length))
    pending: deque[tuple[Span, memoryview, list[Future]]] = deque()
    held = 0
    with open(path, "rb", buffering=0) as stream, ThreadPoolExecutor(HASH_THREADS, "ckptrun-verify") as pool:
        fd = stream.fileno()
        for span in spans:
            _prefetch(fd, span)
            data = allocate(span)
            pending.append((span, data, [pool.submit(_read_piece, fd, span, data, piece, chunks, index, path.name)
                                         for piece, chunks in _pieces(span, index)]))
            held += span.length
            while pending and (held > WINDOW_BYTES or len(pending) > WINDOW_SPANS):
                held -= pending[0][0].length
                yield _checked(*pending.popleft())
        while pending:
            yield _checked(*pending.popleft())


def _pieces(span: Span, index: ChunkIndex | None) -> list[tuple[tuple[int, int], list[Chunk]]]:
    """``span`` cut into (offset, length) pieces of about :data:`PIECE` bytes, each with the chunks that
    tile it: whole chunks when there is an ``index`` (a chunk longer than a piece is one piece), fixed
    slices when there is none (the snapshot was verified whole)."""
    if index is None:
        return [((offset, min(PIECE, span.offset + span.length - offset)), [])
                for offset in range(span.offset, span.offset + span.length, PIECE)] or [((span.offset, 0), [])]
    pieces: list[tuple[tuple[int, int], list[Chunk]]] = []
    for chunk in index.covering(span):
        if pieces and (pieces[-1][0][1] + chunk.length <= PIECE or chunk.length <= SMALL):
            (offset, length), chunks = pieces[-1]
            pieces[-1] = ((offset, length + chunk.length), chunks + [chunk])
        else:
            pieces.append(((chunk.offset, chunk.length), [chunk]))
    return pieces


def _read_piece(fd: int, span: Span, data: memoryview, piece: tuple[int, int], chunks: list[Chunk],
                index: ChunkIndex | None, name: str) -> str | None:
    """Read one piece of ``span`` into its place in ``data`` and check its chunks: a problem, or None."""
    offset, length = piece
    view = data[offset - span.offset:offset - span.offset + length]
    done = 0
    while done < length:
        count = os.preadv(fd, [view[done:done + _MAX_READ]], offset + done)
        if count == 0:
            return f"{name} ends {span.offset + span.length - offset - done} bytes before the end of {span.what}"
        done += count
    if index is None:
        return None
    algorithm = index.entry.algorithm
    for chunk in chunks:
        hasher = new_hasher(algorithm)
        hasher.update(view[chunk.offset - offset:chunk.offset - offset + chunk.length])
        if hasher.hexdigest() != chunk.digest:
            return (f"{index.entry.path} bytes {chunk.offset}..{chunk.offset + chunk.length} ({span.what}): "
                    f"{algorithm} {hasher.hexdigest()[:16]}…, manifest says {chunk.digest[:16]}…")
    return None


def _checked(span: Span, data: memoryview, reads: list[Future]) -> tuple[Span, memoryview]:
    for read in reads:
        problem = read.result()
        if problem:
            raise DigestMismatch(problem)
    return span, data


def _prefetch(fd: int, span: Span) -> None:
    """Ask the kernel to start reading ``span`` from disk now, ahead of the threads that will copy it."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, span.offset, span.length, os.POSIX_FADV_WILLNEED)


def _anonymous(length: int) -> memoryview:
    """Fresh memory for ``length`` bytes (a large buffer is an anonymous mapping: nothing zero-filled first)."""
    return memoryview(mmap.mmap(-1, length) if length >= 1 << 20 else bytearray(length))


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
