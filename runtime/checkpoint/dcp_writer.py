"""The storage DCP saves a snapshot through: every byte hashed on its way to disk, one file per rank.

:func:`hashing_writer` gives DCP a ``FileSystemWriter`` whose file system
records each file's size and digest as it is written — a digest per stored item
(chunk) for the data files, see :mod:`hashing` — so the manifest needs no
second pass over the data. By default the files are in the raw format of
:mod:`raw_dcp` (tensor bytes behind a JSON header, ``metadata.json``; no
pickle); ``legacy=True`` writes DCP's own format (``torch.save`` per item, a
pickled ``.metadata``), which older snapshots have and tests still make.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import threading
from pathlib import Path
from typing import Callable, Generator

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem, _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ckptrun.runtime import collectives
from ckptrun.runtime.checkpoint import raw_dcp
from ckptrun.runtime.checkpoint.writeback import StreamingFile  # S2: data files start writeback as they are written
from ckptrun.runtime.hashing import HashingWriter
from ckptrun.runtime.manifest import DATA_SUFFIXES


class HashingFileSystem(FileSystem):
    """Records (size, digest) of every file DCP writes, keyed by final file name."""

    def __init__(self, algorithm: str, on_write: Callable[[str], None] | None = None) -> None:
        super().__init__()
        self.algorithm = algorithm
        self.on_write = on_write
        self.digests: dict[str, tuple[int, str, list[tuple[int, int, str]] | None]] = {}  # size, digest, chunks
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        chunked = str(path).endswith(DATA_SUFFIXES)  # data files: a digest per item (a tell() around each)
        with StreamingFile(path) as raw, contextlib.closing(HashingWriter(raw, self.algorithm, chunked)) as stream:
            yield stream  # type: ignore[misc]
            if self.on_write is not None:
                self.on_write(Path(path).name)
            with self._lock:
                self.digests[Path(path).name] = (stream.size, stream.hexdigest(), stream.chunks if chunked else None)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        with self._lock:
            if Path(path).name in self.digests:
                self.digests[Path(new_path).name] = self.digests.pop(Path(path).name)


class RankNamedWriter(FileSystemWriter):
    """Each rank's data file is ``__<job rank>_0.safetensors`` (``.distcp``) even when DCP runs on a subgroup (a node's own memory
    snapshot), where DCP would number the files by the rank within the group: a file's name names its writer."""

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        plan = super().prepare_local_plan(plan)
        return dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{collectives.rank()}_"))


class RawWriter(RankNamedWriter):
    """DCP's planning and file naming, our raw format: one data file per rank, ``metadata.json``."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        return raw_dcp.write_rank_file(self, plan, planner)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        raw_dcp.write_metadata(self, metadata, results)


def hashing_writer(dcp_dir: Path, algorithm: str, on_write: Callable[[str], None] | None = None,
                   legacy: bool = False) -> FileSystemWriter:
    """A writer (fsync on, one file per rank) that hashes what it writes: the raw format, or with
    ``legacy`` DCP's own."""
    kind = RankNamedWriter if legacy else RawWriter
    writer = kind(dcp_dir, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=False)
    writer.fs = HashingFileSystem(algorithm, on_write)
    return writer
