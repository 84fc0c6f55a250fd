"""Digests for snapshot files, computed while bytes are written or read.

sha256 (hashlib) is the default; blake3 is used when the optional package is
installed and asked for. The algorithm is recorded per file in the manifest, so
verification never guesses. Importable without torch.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import Any, BinaryIO, Callable

CHUNK = 4 << 20


def new_hasher(algorithm: str) -> Any:
    """A hashlib-style object for ``algorithm`` ('sha256' or 'blake3')."""
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "blake3":
        try:
            import blake3  # type: ignore[import-not-found]
        except ImportError:
            raise ValueError("hash algorithm blake3 needs the blake3 package: pip install blake3") from None
        return blake3.blake3(max_threads=blake3.blake3.AUTO)
    raise ValueError(f"unknown hash algorithm {algorithm!r}; use sha256 or blake3")


def hash_file(path: Path, algorithm: str, progress: Callable[[int], None] | None = None,
              uncached: bool = False) -> tuple[int, str]:
    """Size and hex digest of ``path``, read in large chunks (releases the GIL).

    ``uncached`` first drops the file's pages from the page cache, so the digest is
    of what the disk returns, not of the copy the writer left in memory.
    """
    hasher = new_hasher(algorithm)
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
    return size, hasher.hexdigest()


class HashingWriter(io.RawIOBase):
    """A write-only stream that hashes every byte on its way to ``raw``.

    DCP and our own writers write through it, so a snapshot's digests cost no
    second pass over the data.
    """

    def __init__(self, raw: BinaryIO, algorithm: str) -> None:
        super().__init__()
        self.raw = raw
        self.hasher = new_hasher(algorithm)
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:  # type: ignore[override]
        view = memoryview(data).cast("B")
        written = self.raw.write(view)
        written = len(view) if written is None else written
        self.hasher.update(view[:written])
        self.size += written
        return written

    def tell(self) -> int:
        return self.raw.tell()

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
        return self.hasher.hexdigest()
