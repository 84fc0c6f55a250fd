"""torch.distributed.checkpoint storage that hashes as it writes and unpickles nothing unsafe.

Writing: a ``FileSystem`` whose streams hash every byte on its way to disk, so
DCP's tensor files get their manifest digests without a second pass — a digest
per stored item (chunk) for the data files, see :mod:`hashing`.

Reading: DCP reads ``.metadata`` with plain ``pickle.load`` and loads
non-tensor items with ``weights_only=False``. Our reader unpickles the metadata
with a restricted unpickler that admits only DCP's own metadata classes and
refuses any non-tensor item, so a tampered snapshot cannot run code even when
its manifest digests were updated to match (invariant 5). Before anything is
allocated, every read the metadata declares is checked against the manifest:
plain file names of this ``dcp/`` that the manifest lists, byte ranges inside
those files, declared bytes adding up to the listed ones, and no tensor larger
than the bytes stored for it (in a snapshot of some ranks only, a node's memory
copy, no chunk of it; each rank's load then checks that it reads every element
of its part) — so neither a 2^60-element shape nor a
``../../etc/passwd`` ever reaches the allocator or DCP's reader. Each item is
then read into memory once and, for a chunked (schema 3) manifest, hashed
against the digest of exactly its bytes before it is deserialised
(:mod:`verified_read`); so is ``.metadata`` before it is unpickled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import math
import os
import pickle
import threading
from collections import defaultdict
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Collection, Generator

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.filesystem import FileSystem, _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan
from torch.futures import Future

from ckptrun.runtime import collectives
from ckptrun.runtime.hashing import HashingWriter
from ckptrun.runtime.manifest import Manifest, ManifestError, read_manifest
from ckptrun.runtime.checkpoint.verified_read import ChunkIndex, MemoryFile, Span, read_small, read_spans
from ckptrun.runtime.checkpoint.writeback import StreamingFile  # S2: data files start writeback as they are written

_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in ("Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
                 "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING", "BytesStorageMetadata")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("collections", "OrderedDict"),
}


class UnsafeMetadataError(RuntimeError):
    """The DCP metadata asked for something a checkpoint never needs."""


class RestrictedUnpickler(pickle.Unpickler):
    """Admit DCP metadata classes and torch dtypes; refuse every other global."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeMetadataError(f"DCP metadata refers to {module}.{name}, which a snapshot never needs; refusing to unpickle it")


def load_metadata(dcp_dir: Path, manifest: Manifest | None = None) -> Metadata:
    """Read ``.metadata`` safely (its bytes checked against the manifest first when the manifest is chunked);
    check it describes tensors only, stored where the snapshot's manifest says."""
    manifest = manifest or _manifest_of(dcp_dir)
    entry = next((e for e in manifest.files if e.path == f"{dcp_dir.name}/.metadata"), None)
    if entry is None:
        raise UnsafeMetadataError(f"the manifest does not list {dcp_dir.name}/.metadata")
    data = read_small(dcp_dir.parent, entry, manifest.verified_as_loaded)
    try:
        metadata = RestrictedUnpickler(io.BytesIO(data)).load()
    except UnsafeMetadataError:
        raise
    except Exception as exc:  # a truncated or garbled pickle
        raise UnsafeMetadataError(f"DCP metadata unreadable: {exc}") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeMetadataError("DCP metadata is not a Metadata object")
    for key, item in metadata.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            raise UnsafeMetadataError(f"DCP item {key!r} is not a tensor; snapshots keep non-tensor state in JSON")
    check_declared(metadata, _listed_sizes(dcp_dir, manifest), whole=not manifest.holds_some_ranks_only())
    return metadata


def _manifest_of(dcp_dir: Path) -> Manifest:
    try:
        return read_manifest(dcp_dir.parent)
    except ManifestError as exc:
        raise UnsafeMetadataError(f"DCP metadata cannot be checked: {exc}") from None


def _listed_sizes(dcp_dir: Path, manifest: Manifest) -> dict[str, int]:
    """Manifest size of every data file directly in ``dcp_dir`` (the metadata itself is not data)."""
    prefix = f"{dcp_dir.name}/"
    return {entry.path[len(prefix):]: entry.size for entry in manifest.files
            if entry.path.startswith(prefix) and entry.path != f"{prefix}.metadata"}


def check_declared(metadata: Metadata, sizes: dict[str, int], whole: bool = True) -> None:
    """Every read DCP would do lies inside a listed file, and every tensor is backed by stored bytes: its whole
    shape, or in a snapshot of some ranks only (``whole`` False: a node's memory copy) the chunks it declares,
    which then cover only what those ranks load (each load checks that it reads all of its part)."""
    stored: dict[str, int] = defaultdict(int)
    for index, info in metadata.storage_data.items():
        stored[index.fqn] += _check_storage(index.fqn, info, sizes)
    declared, listed = sum(stored.values()), sum(sizes.values())
    if declared != listed:
        raise UnsafeMetadataError(f"DCP metadata declares {declared} bytes of tensor data, the manifest lists {listed}")
    for fqn, item in metadata.state_dict_metadata.items():
        shape = tuple(item.size)
        if any(dim < 0 for dim in shape):
            raise UnsafeMetadataError(f"DCP tensor {fqn!r} declares shape {shape}")
        for chunk in item.chunks:
            if len(chunk.offsets) != len(shape) or any(o < 0 or s < 0 or o + s > d for o, s, d in zip(chunk.offsets, chunk.sizes, shape)):
                raise UnsafeMetadataError(f"DCP tensor {fqn!r} declares a chunk outside its shape {shape}")
        # what the snapshot holds of it: every chunk (a node's memory snapshot holds only its ranks' shards)
        elements = math.prod(shape) if whole else sum(math.prod(chunk.sizes) for chunk in item.chunks)
        needed = elements * item.properties.dtype.itemsize
        if elements > math.prod(shape) or needed > stored[fqn]:
            raise UnsafeMetadataError(f"DCP tensor {fqn!r} declares shape {shape} ({needed} bytes"
                                      f"{'' if whole else ' in the chunks this snapshot holds'}) but {stored[fqn]} "
                                      "bytes are stored for it")


def _check_storage(fqn: str, info: Any, sizes: dict[str, int]) -> int:
    """The bytes one storage entry declares, once its file and byte range check out."""
    name = info.relative_path
    if not isinstance(name, str) or name in ("", ".", "..") or "\\" in name or PurePosixPath(name).name != name:
        raise UnsafeMetadataError(f"DCP item {fqn!r} is stored in {name!r}, not a plain file name of this snapshot's dcp/")
    if name not in sizes:
        raise UnsafeMetadataError(f"DCP item {fqn!r} is stored in {name!r}, which is not listed in the manifest")
    if info.transform_descriptors:
        raise UnsafeMetadataError(f"DCP item {fqn!r} declares transforms {info.transform_descriptors!r}; snapshots store raw bytes")
    if info.offset < 0 or info.length < 0 or info.offset + info.length > sizes[name]:
        raise UnsafeMetadataError(f"DCP item {fqn!r} declares bytes {info.offset}..{info.offset + info.length} of {name}, "
                                  f"outside its {sizes[name]} bytes")
    return info.length


class SafeReader(FileSystemReader):
    """FileSystemReader whose metadata goes through :func:`load_metadata` and whose items are read once,
    verified as they are read (chunked manifests) and loaded weights-only.

    ``manifest``/``metadata``: already read and checked by the caller (else read here). ``fresh``: keys of
    targets this load allocated, which may take over a loaded item's memory instead of copying it.
    """

    def __init__(self, path: str | os.PathLike, manifest: Manifest | None = None, metadata: Metadata | None = None,
                 fresh: Collection[str] = ()) -> None:
        super().__init__(path)
        self.manifest, self.metadata, self.fresh = manifest, metadata, frozenset(fresh)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        dcp_dir = Path(self.path)
        self.manifest = self.manifest or _manifest_of(dcp_dir)
        metadata = self.metadata or load_metadata(dcp_dir, self.manifest)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Per file, this rank's items in file order: each read once (the next read while the last hashes),
        checked against its chunk digests, deserialised weights-only, and placed into its target."""
        dcp_dir = Path(self.path)
        manifest = self.manifest or _manifest_of(dcp_dir)
        _check_coverage(plan, planner, self.storage_data)
        by_file: dict[str, dict[MetadataIndex, list[ReadItem]]] = defaultdict(lambda: defaultdict(list))
        for request in plan.items:
            if request.type == LoadItemType.BYTE_IO:
                raise UnsafeMetadataError(f"DCP item {request.storage_index.fqn!r} is not a tensor")
            by_file[self.storage_data[request.storage_index].relative_path][request.storage_index].append(request)
        for name, requests in by_file.items():
            order = sorted(requests, key=lambda index: self.storage_data[index].offset)
            spans = [Span(self.storage_data[i].offset, self.storage_data[i].length, f"tensor {i.fqn!r}") for i in order]
            read = read_spans(dcp_dir / name, spans, _chunk_index(manifest, dcp_dir, name), _allocate)
            for (_, data), index in zip(read, order):
                stored = _load_in_place(data)
                if not isinstance(stored, torch.Tensor):
                    raise UnsafeMetadataError(f"DCP item {index.fqn!r} does not hold a tensor")
                for request in requests[index]:
                    self._place(stored, request, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _place(self, stored: torch.Tensor, request: ReadItem, planner: LoadPlanner) -> None:
        """Copy the requested part of ``stored`` into its target; a fresh target that wants all of it takes
        its memory instead (no copy)."""
        piece = narrow_tensor_by_index(stored, request.storage_offsets, request.lengths)
        target = planner.resolve_tensor(request)
        if target.size() != piece.size():
            raise UnsafeMetadataError(f"DCP item {request.storage_index.fqn!r}: stored {tuple(piece.size())}, "
                                      f"expected {tuple(target.size())}")
        whole = piece.size() == stored.size() and target.dtype == stored.dtype and not target.requires_grad
        if whole and request.dest_index.fqn in self.fresh and type(target) is torch.Tensor:
            target.set_(stored)
        else:
            target.detach().copy_(piece)
        planner.commit_tensor(request, target)


def _check_coverage(plan: LoadPlan, planner: LoadPlanner, storage: dict[MetadataIndex, Any]) -> None:
    """Every element of every target this rank loads is read from the snapshot: a snapshot that holds only
    part of a tensor (a node's memory copy, or a tampered ``.metadata``) must fail here, never leave a target
    as it was allocated."""
    covered: dict[str, int] = defaultdict(int)
    for request in plan.items:
        covered[request.dest_index.fqn] += math.prod(request.lengths)
    stored = {index.fqn for index in storage}
    for fqn, value in getattr(planner, "state_dict", {}).items():
        local = value.to_local() if hasattr(value, "to_local") else value
        if fqn in stored and isinstance(local, torch.Tensor) and covered[fqn] != local.numel():
            raise UnsafeMetadataError(f"DCP tensor {fqn!r}: the snapshot holds {covered[fqn]} of the "
                                      f"{local.numel()} elements this rank loads")


def _allocate(length: int) -> memoryview:
    """An item's read buffer from torch's own allocator (as ``torch.load`` allocates, so both pay the same
    for fresh pages), which the loaded tensor then keeps as its storage."""
    return memoryview(torch.empty(length, dtype=torch.uint8).numpy())


def _load_in_place(data: memoryview) -> Any:
    """``torch.load(weights_only=True)`` of one serialised item already in memory, its tensor a view of those
    bytes rather than a copy: the loader ``torch.load(mmap=True)`` itself calls, with the item's buffer as
    the "mapped file" (``overall_storage``). Plain ``torch.load`` (one copy more) on a torch without it."""
    if not _IN_PLACE:
        return torch.load(MemoryFile(data), map_location="cpu", weights_only=True)
    reader = torch._C.PyTorchFileReader(MemoryFile(data))
    storage = torch.frombuffer(data, dtype=torch.uint8).untyped_storage()
    return torch.serialization._load(reader, "cpu", torch.serialization._weights_only_unpickler,
                                     overall_storage=storage, encoding="utf-8")


_IN_PLACE = "overall_storage" in inspect.signature(getattr(torch.serialization, "_load", lambda: None)).parameters


def _chunk_index(manifest: Manifest, dcp_dir: Path, name: str) -> ChunkIndex | None:
    """The chunks of data file ``name`` when the manifest verifies loads (None: the snapshot was verified whole)."""
    if not manifest.verified_as_loaded:
        return None
    entry = next(e for e in manifest.files if e.path == f"{dcp_dir.name}/{name}")
    return ChunkIndex(entry)


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
        chunked = str(path).endswith(".distcp")  # data files: a digest per item (DCP asks tell() around each)
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
    """Each rank's data file is ``__<job rank>_0.distcp`` even when DCP runs on a subgroup (a node's own memory
    snapshot), where DCP would number the files by the rank within the group: a file's name names its writer."""

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        plan = super().prepare_local_plan(plan)
        return dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{collectives.rank()}_"))


def hashing_writer(dcp_dir: Path, algorithm: str, on_write: Callable[[str], None] | None = None) -> FileSystemWriter:
    """A FileSystemWriter (fsync on, one file per rank) that hashes what it writes."""
    writer = RankNamedWriter(dcp_dir, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=False)
    writer.fs = HashingFileSystem(algorithm, on_write)
    return writer


def allocate_from_metadata(metadata: Metadata, keys: list[str],
                           live: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Where DCP loads each stored tensor: the ``live`` one (this rank's shard of the model or
    optimizer, on its device) when its global shape and dtype match, else a new CPU tensor."""
    missing = [key for key in keys if key not in metadata.state_dict_metadata]
    if missing:
        raise KeyError(f"snapshot has no tensor {missing[0]!r}")
    out = {}
    for key in keys:
        item = metadata.state_dict_metadata[key]
        target = (live or {}).get(key)
        if target is None or tuple(target.shape) != tuple(item.size) or target.dtype != item.properties.dtype:
            target = torch.empty(tuple(item.size), dtype=item.properties.dtype)
        out[key] = target
    return out


def owned_keys(tensors: dict[str, torch.Tensor], group: Any = None, first_rank: frozenset[str] = frozenset()) -> set[str]:
    """The keys this rank writes under DCP's own save plan: every shard it holds and, of the tensors
    replicated on several ranks, those DCP's de-duplication assigns to it. Collective on ``group``.

    ``first_rank``: keys held by every rank that only rank 0's copy of is right (DDP's buffers, see
    :func:`train_state.first_rank_keys`): rank 0 writes them, whatever the balancing chose.
    Each rank then stages and saves only these; the union over ranks is the whole state, once.
    """
    me = collectives.rank(group)  # within ``group``: a node's own snapshot is planned among its ranks
    planner = DefaultSavePlanner()
    planner.set_up_planner(tensors, is_coordinator=me == 0)
    plans = collectives.all_gather_object(planner.create_local_plan(), group=group)
    mine = {item.index.fqn for item in dedup_save_plans(plans)[me].items}
    pinned = first_rank & set(tensors)
    return mine | pinned if me == 0 else mine - pinned


def tensor_table(metadata: Metadata) -> dict[str, tuple[list[int], str]]:
    """Global shape and dtype name of every stored tensor (the manifest's ``tensors``)."""
    return {key: (list(item.size), str(item.properties.dtype).removeprefix("torch."))
            for key, item in metadata.state_dict_metadata.items() if isinstance(item, TensorStorageMetadata)}
