"""Digests for snapshot files, computed while bytes are written or read.

sha256 (hashlib) is the default; blake3 is used when the optional package is
installed and asked for. The algorithm is recorded per file in the manifest, so
verification never guesses. Importable without torch.

A DCP data file holds one stored item after another, and with resharding a rank
reads only some of them. So its digest is split into **chunks**: the writer
starts a new hasher wherever DCP asks for the stream position (it does so around
every item) and every :data:`SUB_CHUNK` bytes inside an item (so a large item
hashes on several threads, when written and when read), and the manifest
records each chunk's offset, length and digest. Every item is a run of whole
chunks. Manifests written before sub-chunks have one chunk per item; they are
read the same way. The file's own digest is then the digest of its chunk list
(:func:`chunks_digest`), so every byte is hashed once when written, a loader
checks exactly the chunks it reads, and a whole-file check re-hashes chunk by
chunk (:func:`entry_hasher`). Small files keep a plain digest of their bytes.
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, Iterable, Iterator, Protocol

if TYPE_CHECKING:
    from ckptrun.runtime.manifest import FileEntry

CHUNK = 4 << 20
PARALLEL_MIN = 1 << 20  # a write at least this large is hashed on helper threads while the write syscall runs
SUB_CHUNK = 2 << 20  # a chunked file's chunks end at each item and every this many bytes inside one: a 4 MiB
#                      tensor (1024x1024 fp32) hashes as two halves on two threads, when written and when read
HASH_HELPERS = 2  # threads hashing a large write's chunks beside the write syscall
_this_thread = threading.local()  # .helpers: HASH_HELPERS for writers used on this thread (see helpers())
_pools: dict[tuple[int, int], ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()
os.register_at_fork(after_in_child=_pools.clear)  # a forked child (a warm-started rank) has none of the threads


def helper_pool(count: int) -> ThreadPoolExecutor:
    """The hash helpers, kept for the process's life: a save starts no threads. One pool per size and calling
    thread's priority, as a thread inherits its creator's: a background persist's helpers run at its lowered one."""
    key = (count, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
    with _pools_lock:
        if key not in _pools:
            _pools[key] = ThreadPoolExecutor(count, f"ckptrun-hash{count}")
        return _pools[key]


@contextmanager
def helpers(count: int) -> Iterator[None]:
    """Writers used on this thread hash on ``count`` helpers. A background persist uses one: it shares the
    cores with training, and a second helper cost training more (64 MiB, quiet 2 cores: 86 vs 71 ms lost
    per persist) than it saved the persist."""
    previous = getattr(_this_thread, "helpers", None)
    _this_thread.helpers = count
    try:
        yield
    finally:
        _this_thread.helpers = previous


def new_hasher(algorithm: str, parallel: bool = False) -> Any:
    """A hashlib-style object for ``algorithm`` ('sha256' or 'blake3'). ``parallel``: blake3 spreads each update
    over every core — for one long stream (a whole file). A chunk's hasher stays on its thread: chunks are
    hashed side by side already (the writer's helpers, a receiver beside its network thread), and blake3's own
    threads on 2 MiB chunks cost more than they gained (a 1 GiB replica on 2 cores: 1.40x -> 1.10x a socket copy)."""
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "blake3":
        try:
            import blake3  # type: ignore[import-not-found]
        except ImportError:
            raise ValueError("hash algorithm blake3 needs the blake3 package: pip install blake3") from None
        return blake3.blake3(max_threads=blake3.blake3.AUTO if parallel else 1)
    raise ValueError(f"unknown hash algorithm {algorithm!r}; use sha256 or blake3")


def memory_algorithm(durable: str) -> str:
    """The digest of the memory tier's snapshots and of their replicas on other nodes: blake3 where the package
    is installed (3x sha256's rate on one core here), else the run's. A replica is hashed once more on every
    node that receives it, on the cores training uses: at sha256's rate the hash alone took longer than moving
    the bytes. Durable snapshots keep the run's ``--hash-algorithm``; every manifest names its algorithm."""
    try:
        import blake3  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        return durable
    return "blake3"


class ChunkLike(Protocol):
    offset: int
    length: int
    digest: str


def chunks_digest(algorithm: str, chunks: Iterable[tuple[int, int, str]]) -> str:
    """The digest of a chunked file: ``algorithm`` over its ``offset:length:digest`` lines, in order."""
    hasher = new_hasher(algorithm)
    hasher.update("".join(f"{offset}:{length}:{digest}\n" for offset, length, digest in chunks).encode())
    return hasher.hexdigest()


class ChunkHasher:
    """Takes a chunked file's bytes in order and hashes them chunk by chunk at the manifest's boundaries.

    :meth:`hexdigest` is the chunk-list digest of what it was fed (equal to the entry's digest exactly when
    every chunk matches and nothing is missing or extra); :meth:`bad_chunks` names the chunks that differ.
    """

    def __init__(self, algorithm: str, chunks: list[ChunkLike]) -> None:
        self.algorithm, self.chunks = algorithm, chunks
        self.found: list[str] = []  # the digest computed for each completed chunk
        self.hasher, self.filled, self.extra = new_hasher(algorithm), 0, 0

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            if len(self.found) == len(self.chunks):  # bytes past the last chunk: they change the digest
                self.hasher.update(view)
                self.extra += len(view)
                return
            part = view[:self.chunks[len(self.found)].length - self.filled]
            self.hasher.update(part)
            self.filled += len(part)
            view = view[len(part):]
            if self.filled == self.chunks[len(self.found)].length:
                self.found.append(self.hasher.hexdigest())
                self.hasher, self.filled = new_hasher(self.algorithm), 0

    def hexdigest(self) -> str:
        computed = [(c.offset, c.length, d) for c, d in zip(self.chunks, self.found)]
        if self.filled or self.extra:  # a file cut short (a partial chunk) or too long (a trailing one)
            start = computed[-1][0] + computed[-1][1] if computed else 0
            computed.append((start, self.filled or self.extra, self.hasher.hexdigest()))
        return chunks_digest(self.algorithm, computed)

    def bad_chunks(self) -> list[tuple[ChunkLike, str]]:
        """Each completed chunk whose bytes do not match its digest, with the digest they have."""
        return [(chunk, digest) for chunk, digest in zip(self.chunks, self.found) if digest != chunk.digest]


def entry_hasher(entry: "FileEntry") -> Any:
    """A hasher that takes ``entry``'s file bytes in order and yields the digest its manifest entry records,
    whether the file is chunked or not: the one way a listed file is checked (verify, uploads, downloads)."""
    if entry.chunks is None:
        return new_hasher(entry.algorithm, parallel=True)
    return ChunkHasher(entry.algorithm, entry.chunks)


def hash_file(path: Path, algorithm: str, progress: Callable[[int], None] | None = None,
              uncached: bool = False) -> tuple[int, str]:
    """Size and plain hex digest of ``path`` (a small file's manifest digest)."""
    hasher = new_hasher(algorithm, parallel=True)
    return feed_file(path, hasher, progress, uncached), hasher.hexdigest()


def feed_file(path: Path, hasher: Any, progress: Callable[[int], None] | None = None, uncached: bool = False) -> int:
    """Feed ``path`` to ``hasher`` in large chunks (hashing releases the GIL); return its size.

    ``uncached`` first drops the file's pages from the page cache, so the digest is
    of what the disk returns, not of the copy the writer left in memory.
    """
    size = 0
    with open(path, "rb", buffering=0) as stream:
        if uncached and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(stream.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        buffer = bytearray(CHUNK)
        view = memoryview(buffer)
        while True:
            count = stream.readinto(buffer)
            if not count:
                break
            hasher.update(view[:count])
            size += count
            if progress is not None:
                progress(count)
    return size


class HashingWriter(io.RawIOBase):
    """A write-only stream that hashes every byte on its way to ``raw``.

    DCP and our own writers write through it, so a snapshot's digests cost no
    second pass over the data. A large write is hashed on helper threads while
    the write syscall runs (both release the GIL); the write returns only when
    both are done, so the caller may reuse its buffer. ``chunked``: a new chunk
    starts at every :meth:`tell` and every :data:`SUB_CHUNK` bytes inside an item
    (see the module docstring), so a large write's chunks hash on several helpers at once.
    """

    def __init__(self, raw: BinaryIO, algorithm: str, chunked: bool = False) -> None:
        super().__init__()
        self.raw, self.algorithm, self.chunked = raw, algorithm, chunked
        self.hasher = new_hasher(algorithm)
        self.size = 0
        self.chunks: list[tuple[int, int, str]] = []  # (offset, length, digest), chunked files only
        self._chunk_start = 0
        self._sealed: list[tuple[int, int, Any]] = []  # chunks ended by the current write, hashers still busy
        self._whole = isinstance(raw, io.BufferedIOBase)  # a blocking buffered write takes all bytes or raises

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:  # type: ignore[override]
        view = memoryview(data).cast("B")
        if self._whole and len(view) >= PARALLEL_MIN:
            hashed = self._hash_aside(self._pieces(view))
            try:
                self.raw.write(view)
            finally:
                for future in hashed:
                    future.result()
            written = len(view)
        else:
            written = self.raw.write(view)
            written = len(view) if written is None else written
            for piece, hasher in self._pieces(view[:written]):
                hasher.update(piece)
        self.size += written
        self.chunks += [(offset, length, hasher.hexdigest()) for offset, length, hasher in self._sealed]
        self._sealed = []
        return written

    def _pieces(self, view: memoryview) -> list[tuple[memoryview, Any]]:
        """``view`` cut where chunks end, each piece with the hasher of its chunk (ended chunks are sealed)."""
        if not self.chunked:
            return [(view, self.hasher)]
        pieces, filled = [], self.size - self._chunk_start
        while len(view):
            piece = view[:SUB_CHUNK - filled]
            pieces.append((piece, self.hasher))
            filled, view = filled + len(piece), view[len(piece):]
            if filled == SUB_CHUNK:
                self._sealed.append((self._chunk_start, SUB_CHUNK, self.hasher))
                self.hasher, self._chunk_start, filled = new_hasher(self.algorithm), self._chunk_start + SUB_CHUNK, 0
        return pieces

    def _hash_aside(self, pieces: list[tuple[memoryview, Any]]) -> list[Future]:
        pool = helper_pool(getattr(_this_thread, "helpers", None) or HASH_HELPERS)
        return [pool.submit(hasher.update, piece) for piece, hasher in pieces]

    def tell(self) -> int:
        if self.chunked:
            self._cut()
        return self.raw.tell()

    def _cut(self) -> None:
        """End the current chunk here (nothing happens if it is empty)."""
        if self.size > self._chunk_start:
            self.chunks.append((self._chunk_start, self.size - self._chunk_start, self.hasher.hexdigest()))
            self.hasher, self._chunk_start = new_hasher(self.algorithm), self.size

    def fileno(self) -> int:
        """Flushed first: DCP calls ``os.fsync(stream.fileno())``, which must cover the buffered tail."""
        self.raw.flush()
        return self.raw.fileno()

    def flush(self) -> None:
        if not self.raw.closed:
            self.raw.flush()

    def fsync(self) -> None:
        self.raw.flush()
        os.fsync(self.raw.fileno())

    def close(self) -> None:
        if not self.closed:
            super().close()
            self.raw.close()

    def hexdigest(self) -> str:
        """The file's manifest digest: of its bytes, or of its chunk list when ``chunked``."""
        if not self.chunked:
            return self.hasher.hexdigest()
        self._cut()
        return chunks_digest(self.algorithm, self.chunks)
