"""Tensors as raw bytes behind a JSON header: the safetensors layout, with no pickle anywhere.

A file is an 8-byte little-endian header length, a JSON header (padded with
spaces to 8 bytes) naming each tensor's dtype, shape and byte range, then the
tensors' bytes back to back in that order — what ``safetensors.safe_open``
reads, so a snapshot's data files open in the Hugging Face tools too. Loading
one runs no code: the header is JSON, a tensor is a dtype and a shape put on
bytes already read (and hashed) into place.

Used for every tensor file of a snapshot: each rank's DCP data file (its shards,
with their place in the global tensor in the header's ``__metadata__``, as
DCP's own Hugging Face writer records it) and each rank's own small tensors
(RNG states). The module knows the layout only; who writes what is
:mod:`raw_dcp` and :mod:`snapshot`.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import torch

NAMES = {  # torch dtype -> the safetensors name (DCP's Hugging Face reader reads these)
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.complex64: "C64",
}
DTYPES = {name: dtype for dtype, name in NAMES.items()}
METADATA = "__metadata__"
ALIGN = 8  # the data starts on an 8-byte boundary (the safetensors convention)


class TensorFileError(ValueError):
    """A tensor file's header is not one this module writes (or was tampered with)."""


def dtype_name(dtype: torch.dtype) -> str:
    """The header's name for ``dtype``: the safetensors one, else torch's own (``torch.`` dropped)."""
    return NAMES.get(dtype) or str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype a header names, refusing anything that is not a dtype."""
    if name in DTYPES:
        return DTYPES[name]
    found = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(found, torch.dtype):
        raise TensorFileError(f"unknown dtype {name!r} in a tensor file header")
    return found


def header(entries: list[tuple[str, torch.dtype, list[int]]], metadata: dict[str, str] | None = None) -> bytes:
    """The file's first bytes (length + JSON header) for tensors stored in this order with these shapes."""
    document: dict[str, Any] = {METADATA: {"format": "pt", **(metadata or {})}}
    offset = 0
    for name, dtype, shape in entries:
        if name in document:
            raise TensorFileError(f"tensor {name!r} appears twice in one file")
        length = math.prod(shape) * dtype.itemsize
        document[name] = {"dtype": dtype_name(dtype), "shape": list(shape), "data_offsets": [offset, offset + length]}
        offset += length
    text = json.dumps(document, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % ALIGN)
    return struct.pack("<Q", len(text)) + text


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def as_tensor(data: Any, dtype: torch.dtype, shape: list[int] | tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` over ``data`` (bytes already read), sharing its memory."""
    expected = math.prod(shape) * dtype.itemsize
    view = memoryview(data).cast("B")
    if view.readonly:  # torch tensors are writable: an immutable buffer (bytes) is copied once
        view = memoryview(bytearray(view))
    if len(view) != expected:
        raise TensorFileError(f"{len(view)} bytes stored for a {dtype_name(dtype)} tensor of shape {list(shape)} "
                              f"({expected} bytes)")
    if expected == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.frombuffer(view, dtype=torch.uint8).view(dtype).reshape(tuple(shape))


def encode(tensors: dict[str, torch.Tensor]) -> list[Any]:
    """A small file's pieces (header, then each tensor's bytes) for ``tensors`` (CPU), in key order."""
    ready = {name: t.detach().to("cpu").contiguous() for name, t in sorted(tensors.items())}
    head = header([(name, t.dtype, list(t.shape)) for name, t in ready.items()])
    return [head, *(raw_bytes(t) for t in ready.values())]


def parse(data: bytes | bytearray | memoryview) -> tuple[dict[str, tuple[torch.dtype, list[int], int, int]], dict[str, str], int]:
    """The header of a file held in memory: {name: (dtype, shape, begin, end)} with offsets into the data,
    the ``__metadata__`` strings, and where the data starts. Every range is checked against the file."""
    view = memoryview(data).cast("B")
    if len(view) < 8:
        raise TensorFileError("a tensor file shorter than its header length")
    length = struct.unpack("<Q", view[:8])[0]
    if 8 + length > len(view):
        raise TensorFileError(f"a tensor file header of {length} bytes runs past the file's {len(view)}")
    try:
        document = json.loads(bytes(view[8:8 + length]))
    except ValueError as exc:
        raise TensorFileError(f"a tensor file header is not JSON: {exc}") from None
    if not isinstance(document, dict):
        raise TensorFileError("a tensor file header is not a JSON object")
    metadata = document.pop(METADATA, {}) or {}
    start, size = 8 + length, len(view) - 8 - length
    entries = {}
    for name, entry in document.items():
        try:
            dtype, shape, (begin, end) = dtype_of(entry["dtype"]), [int(d) for d in entry["shape"]], entry["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise TensorFileError(f"tensor {name!r}: malformed header entry ({exc})") from None
        if any(d < 0 for d in shape) or not 0 <= begin <= end <= size or end - begin != math.prod(shape) * dtype.itemsize:
            raise TensorFileError(f"tensor {name!r}: shape {shape} {dtype_name(dtype)} does not fit bytes {begin}..{end} "
                                  f"of the file's {size} data bytes")
        entries[name] = (dtype, shape, begin, end)
    return entries, metadata, start


def decode(data: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
    """Every tensor of a small file held in memory (each a view of those bytes)."""
    entries, _, start = parse(data)
    view = memoryview(data).cast("B")
    return {name: as_tensor(view[start + begin:start + end], dtype, shape)
            for name, (dtype, shape, begin, end) in entries.items()}
