"""Contract C2's manifest: what a published snapshot holds, with a digest per file.

A directory without a valid manifest is not a snapshot. The manifest is the
last file written before the atomic rename, so its presence in a published
directory means every file it lists was fsynced first. Importable without torch.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path, PurePosixPath
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

SCHEMA_VERSION = 3  # 3: chunk digests per DCP data file; 2: writer rank per file, global shape and dtype per tensor
READABLE_SCHEMAS = (1, 2, 3)  # older manifests lack those; they still verify (whole files) and load
MANIFEST_NAME = "manifest.json"


class ManifestError(ValueError):
    """The manifest is missing, unreadable or invalid; the message says which."""


class Chunk(BaseModel):
    """A run of bytes inside a DCP data file, with their own digest (see :mod:`hashing`): a whole stored item,
    or a piece of one (a large item is cut every ``hashing.SUB_CHUNK`` bytes; manifests written before that
    hold one chunk per item). Every item is a run of whole chunks."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    offset: int = Field(ge=0)
    length: int = Field(gt=0)
    digest: str = Field(description="Lower-case hex digest of bytes offset..offset+length, same algorithm as the file's.")


class FileEntry(BaseModel):
    """One file of a snapshot: where it is, how big, and its digest."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(description="Relative POSIX path inside the snapshot directory.")
    size: int = Field(ge=0)
    algorithm: str = Field(description="Hash algorithm of `digest` (sha256, blake3).")
    digest: str = Field(description="Lower-case hex digest of the file's bytes or, for a chunked file, of its "
                                    "chunk list (hashing.chunks_digest).")
    rank: int | None = Field(None, ge=0, description="The rank that wrote the file (None in schema 1 manifests).")
    chunks: list[Chunk] | None = Field(None, description="DCP data files (schema 3): digests of runs of bytes that "
                                                          "tile the file, each item a run of whole chunks; None for "
                                                          "other files.")

    @field_validator("path")
    @classmethod
    def _confined(cls, value: str) -> str:
        """Refuse paths that could leave the snapshot directory (invariant 5)."""
        pure = PurePosixPath(value)
        if not value or pure.is_absolute() or ".." in pure.parts or "\\" in value or value.startswith("~"):
            raise ValueError(f"path {value!r} leaves the snapshot directory")
        if pure.name == MANIFEST_NAME and len(pure.parts) == 1:
            raise ValueError("the manifest cannot list itself")
        return value

    @model_validator(mode="after")
    def _chunks_tile_the_file(self) -> "FileEntry":
        """Chunks start at 0 and follow one another to the file's end, so each byte has exactly one digest."""
        if self.chunks is not None:
            end = 0
            for chunk in self.chunks:
                if chunk.offset != end:
                    raise ValueError(f"{self.path}: chunk at byte {chunk.offset}, expected one at {end}")
                end += chunk.length
            if end != self.size:
                raise ValueError(f"{self.path}: chunks cover {end} bytes of {self.size}")
        return self


class TensorEntry(BaseModel):
    """One stored tensor as the whole job sees it, whichever ranks hold its shards."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shape: list[int] = Field(description="Global shape, the same at every world size.")
    dtype: str = Field(description="torch dtype name without the `torch.` prefix.")

    @field_validator("shape")
    @classmethod
    def _non_negative(cls, value: list[int]) -> list[int]:
        if any(dim < 0 for dim in value):
            raise ValueError(f"shape {value} has a negative dimension")
        return value


class Manifest(BaseModel):
    """Everything needed to trust, restore and trace one snapshot."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int = Field(SCHEMA_VERSION, description="Bumped on incompatible changes.")
    run_id: str
    lineage: str = Field(description="Id of the line of snapshots this one continues.")
    parent: str | None = Field(None, description="Name of the previous snapshot of this line, or the fork point.")
    step: int = Field(ge=0, description="Optimizer steps completed.")
    epoch: int = Field(0, ge=0)
    samples_seen: int = Field(0, ge=0, description="Global samples consumed since the start of training.")
    world_size: int = Field(ge=1)
    world_size_history: list[dict[str, int]] = Field(
        default_factory=list, description="The lineage's world sizes, [{step, world_size}]: each from that step on "
                                          "(a resume at another size adds one); empty in older snapshots.")
    precision: str = "fp32"
    config: dict[str, Any] = Field(default_factory=dict, description="The training script's config at save time.")
    torch_version: str = ""
    code_version: str = Field("", description="Digest of the training script (reported, not enforced, on resume).")
    created: float = Field(default_factory=time.time)
    files: list[FileEntry]
    tensors: dict[str, TensorEntry] = Field(default_factory=dict, description="Every DCP tensor item by key: global shape and dtype.")
    extra: dict[str, Any] = Field(default_factory=dict, description="Small facts for humans (save timings).")

    @field_validator("schema_version")
    @classmethod
    def _known_schema(cls, value: int) -> int:
        if value not in READABLE_SCHEMAS:
            raise ValueError(f"schema version {value} is not one of {READABLE_SCHEMAS}; use the ckptrun that wrote it")
        return value

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files)

    @property
    def verified_as_loaded(self) -> bool:
        """Whether a load checks every byte it reads against this manifest: every DCP data file has chunk
        digests (schema 3). Then a pre-load check needs only manifest and sizes; else it hashes whole files."""
        data = [entry for entry in self.files if is_data_file(entry.path)]
        return self.schema_version >= 3 and bool(data) and all(entry.chunks is not None for entry in data)

    def sharding_problems(self) -> list[str]:
        """What a sharded (schema 2) manifest gets wrong about who wrote what: each DCP data file
        ``__R_N.safetensors`` (``.distcp``) and per-rank file names its writer rank R, below the world size."""
        if self.schema_version < 2:
            return []
        problems = []
        for entry in self.files:
            named = _named_rank(entry.path)
            if entry.rank is None:
                problems.append(f"{entry.path}: no writer rank")
            elif entry.rank >= self.world_size or (named is not None and named != entry.rank):
                problems.append(f"{entry.path}: writer rank {entry.rank} does not match its name or world size {self.world_size}")
        if any(_holds_tensors(entry) for entry in self.files) and not self.tensors:
            problems.append("dcp/ holds tensors but the manifest lists no tensor shapes")
        return problems

    def holds_some_ranks_only(self) -> bool:
        """A snapshot of some of the job's ranks (a node's memory copy on many nodes: its own ranks' files and
        shards), not of the whole job: per-rank files of fewer ranks than the world size."""
        writers = {entry.rank for entry in self.files if entry.rank is not None and _named_rank(entry.path) is not None}
        return self.schema_version >= 2 and bool(writers) and writers != set(range(self.world_size))

    def to_json(self) -> str:
        document = self.model_dump(mode="json")
        for entry in document["files"]:  # only DCP data files have chunks: no `"chunks": null` on the others
            if entry["chunks"] is None:
                del entry["chunks"]
        return json.dumps(document, indent=1, sort_keys=True)


FRAMEWORK_SCHEMA_VERSION = 1
SIDECAR_SUFFIX = ".ckptrun.json"  # a framework's checkpoint file X gets X.ckptrun.json beside it
DIRECTORY_MANIFEST = "ckptrun-manifest.json"  # a framework's checkpoint directory gets one inside it


class FrameworkManifest(BaseModel):
    """A framework's own checkpoint (a Lightning ``.ckpt`` file, a Hugging Face ``checkpoint-N`` directory),
    published by ckptrun: written last, so its presence means every file it lists was fsynced first.
    File paths are relative to the checkpoint directory (for a single file: its parent)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int = Field(FRAMEWORK_SCHEMA_VERSION, description="Bumped on incompatible changes.")
    framework: str = Field(description="Who wrote the checkpoint: lightning, transformers.")
    run_id: str
    step: int = Field(ge=0, description="The framework's global step (optimizer steps across attempts).")
    created: float = Field(default_factory=time.time)
    files: list[FileEntry]

    @field_validator("schema_version")
    @classmethod
    def _known_schema(cls, value: int) -> int:
        if value != FRAMEWORK_SCHEMA_VERSION:
            raise ValueError(f"schema version {value} is not {FRAMEWORK_SCHEMA_VERSION}; use the ckptrun that wrote it")
        return value


def read_framework_manifest(path: Path) -> FrameworkManifest:
    """Parse a framework checkpoint's manifest (a sidecar or a directory's) or raise :class:`ManifestError`."""
    try:
        return FrameworkManifest.model_validate_json(path.read_text())
    except FileNotFoundError:
        raise ManifestError(f"{path}: missing") from None
    except OSError as exc:
        raise ManifestError(f"{path}: unreadable ({exc.strerror})") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "document"
        raise ManifestError(f"{path}: invalid at {where}: {first['msg']}") from None


DATA_SUFFIXES = (".safetensors", ".distcp")  # a rank's DCP data file: raw tensor files, or (older) torch.save items


def _holds_tensors(entry: FileEntry) -> bool:
    """Whether a listed file of ``dcp/`` may hold tensor bytes: a raw data file whose chunks are more than its
    header (a state with nothing shared, every tracked object per rank, writes header-only files), any other."""
    if not entry.path.startswith("dcp/") or entry.path.endswith(".json"):
        return False
    return not (entry.path.endswith(".safetensors") and entry.chunks is not None and len(entry.chunks) <= 1)


def is_data_file(path: str) -> bool:
    """Whether a listed file is one of DCP's data files (``dcp/__R_N.safetensors``, older ``.distcp``): the
    files whose digests are kept per chunk."""
    return path.startswith("dcp/") and path.endswith(DATA_SUFFIXES)


def _named_rank(path: str) -> int | None:
    """The rank a file's name says wrote it: a DCP data file ``__R_N.safetensors`` (``.distcp`` before raw
    tensor files) and our ``rank-R.*``; None for shared files."""
    name = PurePosixPath(path).name
    match = re.fullmatch(r"__(\d+)_\d+\.(?:safetensors|distcp)|rank-(\d+)\.\w+", name)
    return int(match.group(1) or match.group(2)) if match else None


def read_manifest(snapshot_dir: Path) -> Manifest:
    """Parse and validate ``snapshot_dir/manifest.json`` or raise :class:`ManifestError`."""
    path = snapshot_dir / MANIFEST_NAME
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ManifestError(f"{path}: missing") from None
    except OSError as exc:
        raise ManifestError(f"{path}: unreadable ({exc.strerror})") from None
    try:
        return Manifest.model_validate_json(text)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "document"
        raise ManifestError(f"{path}: invalid at {where}: {first['msg']}") from None
