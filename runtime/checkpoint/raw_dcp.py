"""The snapshot format DCP writes through us: raw tensor bytes, JSON metadata, no pickle (snapshot format 2).

DCP plans a save (which rank writes which shard) and a load (which stored
chunks fill which part of which target, at any world size); the storage
behind it is ours. Each rank writes one data file, ``dcp/__<rank>_0.safetensors``, in
the safetensors layout (:mod:`tensor_file`): a JSON header naming its chunks and
their place in the global tensors, then their bytes, written straight from the
staged tensors — no ``torch.save`` per item, no zip, nothing for the GIL
between the write calls but the loop. The coordinator writes
``dcp/metadata.json`` where DCP writes its pickled ``.metadata``: the same
facts (every tensor's global shape, dtype and chunks; where each chunk's bytes
are), in JSON. Reading them back is :mod:`dcp_io`'s ``SafeReader``, which reads
each chunk with ``preadv`` into the tensor it restores and hashes it as it
arrives.

Snapshots written before (format 1: ``torch.save`` items and a pickled
``.metadata``) keep loading through the restricted unpickler in :mod:`dcp_io`.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ckptrun.runtime.checkpoint import tensor_file
from ckptrun.runtime.checkpoint.writeback import WINDOW

METADATA_JSON = "metadata.json"
FORMAT = "ckptrun-raw-1"
SHARDING_KEY = "DCP_SHARDING_INFO"  # as DCP's Hugging Face writer names a chunk's place in its tensor
GLOBAL_KEY = "ckptrun_global_shapes"


class RawMetadataError(ValueError):
    """``metadata.json`` is not what a save writes."""


def write_rank_file(writer: Any, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
    """Write this rank's items into its one data file (``writer``: a FileSystemWriter, for its path,
    file system and fsync setting): header first, then each chunk's bytes in pieces of the writeback window."""
    name = f"{plan.storage_data.prefix}0.safetensors"
    chunks: list[tuple[Any, torch.Tensor]] = []
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO:
            raise TypeError(f"snapshot item {item.index.fqn!r} is not a tensor; non-tensor state goes to JSON")
        chunks.append((item, planner.resolve_data(item).detach().to("cpu").contiguous()))
    sharding = {item.index.fqn: {"saved_offsets": list(item.tensor_data.chunk.offsets)} for item, _ in chunks}
    shapes = {item.index.fqn: list(item.tensor_data.size) for item, _ in chunks}
    head = tensor_file.header([(item.index.fqn, tensor.dtype, list(tensor.shape)) for item, tensor in chunks],
                              {SHARDING_KEY: json.dumps(sharding), GLOBAL_KEY: json.dumps(shapes)})
    results = []
    with writer.fs.create_stream(writer.fs.concat_path(writer.path, name), "wb") as stream:
        stream.write(head)
        for item, tensor in chunks:
            offset = stream.tell()  # a chunk digest ends here: one run of digests per item
            data = tensor_file.raw_bytes(tensor)
            for start in range(0, len(data), WINDOW):
                stream.write(data[start:start + WINDOW])
            results.append(WriteResult(index=item.index, size_in_bytes=len(data),
                                       storage_data=_StorageInfo(name, offset, len(data))))
        stream.tell()
        if writer.sync_files:
            os.fsync(stream.fileno())
    done: Future[list[WriteResult]] = Future()
    done.set_result(results)
    return done


def write_metadata(writer: Any, metadata: Metadata, results: list[list[WriteResult]]) -> None:
    """The coordinator's ``metadata.json`` (written under a temporary name, fsynced, renamed)."""
    metadata.storage_data = {result.index: result.storage_data for rank_results in results for result in rank_results}
    temp = writer.fs.concat_path(writer.path, f"{METADATA_JSON}.tmp")
    with writer.fs.create_stream(temp, "wb") as stream:
        stream.write(encode_metadata(metadata))
        if writer.sync_files:
            os.fsync(stream.fileno())
    writer.fs.rename(temp, writer.fs.concat_path(writer.path, METADATA_JSON))


def encode_metadata(metadata: Metadata) -> bytes:
    """``metadata.json``'s bytes: every tensor's dtype, global size and chunks; where each chunk is stored."""
    for fqn, item in metadata.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            raise TypeError(f"snapshot item {fqn!r} is not a tensor")
    document = {
        "format": FORMAT,
        "tensors": {fqn: {"dtype": tensor_file.dtype_name(item.properties.dtype), "size": list(item.size),
                          "chunks": [[list(c.offsets), list(c.sizes)] for c in item.chunks]}
                    for fqn, item in metadata.state_dict_metadata.items()},
        "storage": [[index.fqn, list(index.offset or []), info.relative_path, info.offset, info.length]
                    for index, info in metadata.storage_data.items()],
    }
    return json.dumps(document, separators=(",", ":")).encode()


def read_metadata(data: bytes) -> Metadata:
    """DCP's metadata from ``metadata.json``'s bytes: plain JSON, each field checked for its type."""
    try:
        document = json.loads(data)
        if document.get("format") != FORMAT:
            raise RawMetadataError(f"format {document.get('format')!r}, expected {FORMAT!r}")
        tensors = {str(fqn): _tensor(item) for fqn, item in document["tensors"].items()}
        storage = {MetadataIndex(str(fqn), torch.Size(_ints(offset))): _StorageInfo(str(name), int(start), int(length))
                   for fqn, offset, name, start, length in document["storage"]}
    except RawMetadataError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise RawMetadataError(f"{METADATA_JSON} is malformed: {type(exc).__name__}: {exc}") from None
    return Metadata(state_dict_metadata=tensors, storage_data=storage)


def _tensor(item: dict[str, Any]) -> TensorStorageMetadata:
    dtype = tensor_file.dtype_of(str(item["dtype"]))
    chunks = [ChunkStorageMetadata(offsets=torch.Size(_ints(offsets)), sizes=torch.Size(_ints(sizes)))
              for offsets, sizes in item["chunks"]]
    return TensorStorageMetadata(properties=TensorProperties(dtype=dtype), size=torch.Size(_ints(item["size"])),
                                 chunks=chunks)


def _ints(values: Any) -> list[int]:
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise RawMetadataError(f"{METADATA_JSON}: expected a list of integers, got {values!r}")
    return values


def chunk_shapes(metadata: Metadata) -> dict[MetadataIndex, tuple[torch.dtype, tuple[int, ...]]]:
    """Dtype and shape of every stored chunk, by its storage index (what a raw item's bytes are)."""
    shapes = {}
    for fqn, item in metadata.state_dict_metadata.items():
        for chunk in item.chunks:
            shapes[MetadataIndex(fqn, chunk.offsets)] = (item.properties.dtype, tuple(chunk.sizes))
    return shapes


def check_lengths(metadata: Metadata) -> None:
    """Every stored chunk's byte length is its shape's: raw bytes carry no framing of their own."""
    shapes = chunk_shapes(metadata)
    for index, info in metadata.storage_data.items():
        if index not in shapes:
            raise RawMetadataError(f"{METADATA_JSON}: bytes stored for {index.fqn!r} at {list(index.offset or [])}, "
                                   "which no chunk of it declares")
        dtype, sizes = shapes[index]
        if info.length != math.prod(sizes) * dtype.itemsize:
            raise RawMetadataError(f"{METADATA_JSON}: {index.fqn!r} at {list(index.offset or [])} declares {info.length} "
                                   f"bytes for a {list(sizes)} {dtype} chunk")


def check_layout(metadata: Metadata, sizes: dict[str, int]) -> None:
    """Each listed data file is its header and then the chunks the metadata places in it, back to back to the
    file's end: no byte of a file is left undeclared, none declared twice."""
    spans: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in metadata.storage_data.items():
        spans.setdefault(info.relative_path, []).append((info.offset, info.length, index.fqn))
    for name, found in spans.items():
        found.sort()
        at = sizes[name] - sum(length for _, length, _ in found)  # where the data starts: after the header
        if at < 8:
            raise RawMetadataError(f"{METADATA_JSON} declares {sizes[name] - at + 8} bytes of data in {name}, "
                                   f"which holds {sizes[name]} with its header")
        for offset, length, fqn in found:
            if offset != at:
                raise RawMetadataError(f"{METADATA_JSON}: {fqn!r} declared at byte {offset} of {name}, where the "
                                       f"chunk before it ends at {at}")
            at += length


def is_raw(dcp_dir: Path, listed: set[str]) -> bool:
    """Whether a snapshot's ``dcp/`` is in this format (its manifest lists ``metadata.json``)."""
    return f"{dcp_dir.name}/{METADATA_JSON}" in listed
