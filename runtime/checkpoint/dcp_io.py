"""Reading a snapshot's ``dcp/`` through torch.distributed.checkpoint, running no code from it.

The metadata is ``metadata.json`` (the raw format, :mod:`raw_dcp`), parsed as
JSON; in snapshots written before, DCP's pickled ``.metadata``, which our
reader unpickles with a restricted unpickler that admits only DCP's own
metadata classes (DCP itself would ``pickle.load`` it and load non-tensor items
with ``weights_only=False``), refusing any non-tensor item, so a tampered
snapshot cannot run code even when its manifest digests were updated to match
(invariant 5). Writing is :mod:`dcp_writer`. Before anything is
allocated, every read the metadata declares is checked against the manifest:
plain file names of this ``dcp/`` that the manifest lists, byte ranges inside
those files, declared bytes adding up to the listed ones, and no tensor larger
than the bytes stored for it (in a snapshot of some ranks only, a node's memory
copy, no chunk of it; each rank's load then checks that it reads every element
of its part) — so neither a 2^60-element shape nor a
``../../etc/passwd`` ever reaches the allocator or DCP's reader. Each item is
then read once — a raw chunk straight into the tensor it fills — and, for a
chunked (schema 3) manifest, hashed against the digest of exactly its bytes
before it is used (:mod:`verified_read`); so is the metadata before it is parsed.
"""

from __future__ import annotations

import inspect
import io
import math
import os
import pickle
from collections import defaultdict
from pathlib import Path, PurePosixPath
from typing import Any, Collection

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from ckptrun.runtime import collectives
from ckptrun.runtime.checkpoint import raw_dcp, tensor_file
from ckptrun.runtime.manifest import Manifest, ManifestError, read_manifest
from ckptrun.runtime.checkpoint.verified_read import ChunkIndex, MemoryFile, Span, read_small, read_spans

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
    """Read the DCP metadata safely (its bytes checked against the manifest first when the manifest is chunked):
    ``metadata.json`` (raw format) parsed as JSON, an older ``.metadata`` through the restricted unpickler;
    check it describes tensors only, stored where the snapshot's manifest says."""
    manifest = manifest or _manifest_of(dcp_dir)
    listed = {entry.path: entry for entry in manifest.files}
    raw = raw_dcp.is_raw(dcp_dir, set(listed))
    entry = listed.get(f"{dcp_dir.name}/{raw_dcp.METADATA_JSON if raw else '.metadata'}")
    if entry is None:
        raise UnsafeMetadataError(f"the manifest lists neither {dcp_dir.name}/{raw_dcp.METADATA_JSON} nor {dcp_dir.name}/.metadata")
    data = read_small(dcp_dir.parent, entry, manifest.verified_as_loaded)
    try:
        metadata = raw_dcp.read_metadata(data) if raw else RestrictedUnpickler(io.BytesIO(data)).load()
    except UnsafeMetadataError:
        raise
    except Exception as exc:  # a truncated or garbled pickle, malformed JSON
        raise UnsafeMetadataError(f"DCP metadata unreadable: {exc}") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeMetadataError("DCP metadata is not a Metadata object")
    for key, item in metadata.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            raise UnsafeMetadataError(f"DCP item {key!r} is not a tensor; snapshots keep non-tensor state in JSON")
    check_declared(metadata, _listed_sizes(dcp_dir, manifest), whole=not manifest.holds_some_ranks_only(), raw=raw)
    if raw:
        try:
            raw_dcp.check_lengths(metadata)
        except raw_dcp.RawMetadataError as exc:
            raise UnsafeMetadataError(str(exc)) from None
    return metadata


def _manifest_of(dcp_dir: Path) -> Manifest:
    try:
        return read_manifest(dcp_dir.parent)
    except ManifestError as exc:
        raise UnsafeMetadataError(f"DCP metadata cannot be checked: {exc}") from None


def _listed_sizes(dcp_dir: Path, manifest: Manifest) -> dict[str, int]:
    """Manifest size of every data file directly in ``dcp_dir`` (the metadata itself is not data)."""
    prefix, metadata = f"{dcp_dir.name}/", {".metadata", raw_dcp.METADATA_JSON}
    return {entry.path[len(prefix):]: entry.size for entry in manifest.files
            if entry.path.startswith(prefix) and entry.path[len(prefix):] not in metadata}


def check_declared(metadata: Metadata, sizes: dict[str, int], whole: bool = True, raw: bool = False) -> None:
    """Every read DCP would do lies inside a listed file, and every tensor is backed by stored bytes: its whole
    shape, or in a snapshot of some ranks only (``whole`` False: a node's memory copy) the chunks it declares,
    which then cover only what those ranks load (each load checks that it reads all of its part). ``raw``:
    each file is a header and then exactly its declared chunks, back to back, to its end."""
    stored: dict[str, int] = defaultdict(int)
    for index, info in metadata.storage_data.items():
        stored[index.fqn] += _check_storage(index.fqn, info, sizes)
    if raw:
        try:
            raw_dcp.check_layout(metadata, sizes)
        except raw_dcp.RawMetadataError as exc:
            raise UnsafeMetadataError(str(exc)) from None
    declared, listed = sum(stored.values()), sum(sizes.values())
    if not raw and declared != listed:
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
    verified as they are read (chunked manifests) and deserialised by nothing (raw format) or weights-only.

    ``manifest``/``metadata``: already read and checked by the caller (else read here). ``fresh``: keys of
    targets this load allocated, which may take over a loaded item's memory instead of copying it.

    Raw format: a stored chunk that fills a whole CPU target of its dtype is read with ``preadv`` straight
    into that target's memory and hashed there (no buffer, no copy). A load that then fails a digest has
    written some targets already; the restore loads an older snapshot into every one of them, or stops.
    """

    def __init__(self, path: str | os.PathLike, manifest: Manifest | None = None, metadata: Metadata | None = None,
                 fresh: Collection[str] = ()) -> None:
        super().__init__(path)
        self.manifest, self.metadata, self.fresh = manifest, metadata, frozenset(fresh)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        dcp_dir = Path(self.path)
        self.manifest = self.manifest or _manifest_of(dcp_dir)
        metadata = self.metadata = self.metadata or load_metadata(dcp_dir, self.manifest)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Per file, this rank's items in file order: each read once (the next read while the last hashes),
        checked against its chunk digests, and placed into its target (raw: read into it where it can)."""
        dcp_dir = Path(self.path)
        manifest = self.manifest or _manifest_of(dcp_dir)
        _check_coverage(plan, planner, self.storage_data)
        raw = raw_dcp.is_raw(dcp_dir, {entry.path for entry in manifest.files})
        shapes = raw_dcp.chunk_shapes(self.metadata or self.read_metadata()) if raw else {}
        by_file: dict[str, dict[MetadataIndex, list[ReadItem]]] = defaultdict(lambda: defaultdict(list))
        for request in plan.items:
            if request.type == LoadItemType.BYTE_IO:
                raise UnsafeMetadataError(f"DCP item {request.storage_index.fqn!r} is not a tensor")
            by_file[self.storage_data[request.storage_index].relative_path][request.storage_index].append(request)
        heads = _header_spans(self.storage_data) if raw else {}
        for name, requests in by_file.items():
            order = sorted(requests, key=lambda index: self.storage_data[index].offset)
            spans = [Span(self.storage_data[i].offset, self.storage_data[i].length, f"tensor {i.fqn!r}") for i in order]
            into = {span: target for span, index in zip(spans, order)
                    if raw and (target := _whole_target(requests[index], shapes[index], planner)) is not None}
            read = read_spans(dcp_dir / name, [heads[name]] + spans if raw else spans, _chunk_index(manifest, dcp_dir, name),
                              lambda span: tensor_file.raw_bytes(into[span].detach()) if span in into else _allocate(span.length))
            if raw:
                next(read)  # the file's header, checked against its digests like every byte a load reads; not used
            for (span, data), index in zip(read, order):
                if span in into:  # already in place
                    planner.commit_tensor(requests[index][0], into[span])
                    continue
                stored = tensor_file.as_tensor(data, *shapes[index]) if raw else _load_in_place(data)
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


def _header_spans(storage: dict[MetadataIndex, Any]) -> dict[str, Span]:
    """Each raw data file's header: its bytes before the first chunk."""
    starts: dict[str, int] = {}
    for info in storage.values():
        starts[info.relative_path] = min(starts.get(info.relative_path, info.offset), info.offset)
    return {name: Span(0, start, "its header") for name, start in starts.items()}


def _whole_target(requests: list[ReadItem], stored: tuple[torch.dtype, tuple[int, ...]], planner: LoadPlanner) -> torch.Tensor | None:
    """The target a raw chunk can be read straight into: one request for the whole chunk, filling a
    contiguous CPU tensor of the same dtype and shape (else None: read into a buffer, then copied)."""
    dtype, sizes = stored
    if len(requests) != 1 or list(requests[0].lengths) != list(sizes) or any(requests[0].storage_offsets):
        return None
    target = planner.resolve_tensor(requests[0])
    usable = (isinstance(target, torch.Tensor) and target.device.type == "cpu" and target.dtype == dtype
              and tuple(target.size()) == tuple(sizes) and target.is_contiguous() and target.numel() > 0)
    return target if usable else None


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
