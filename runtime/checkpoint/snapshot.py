"""Saving and loading the whole training state as one verified snapshot (contract C2).

Three phases, kept apart even while they run inline:

* **stage** (:mod:`saver`, :mod:`staging`) — copy this rank's share of the
  tensors into host buffers allocated once and reused (a sync save of CPU
  tensors writes them as they are); the only part the training step waits for.
* **persist** — model/optimizer/EMA tensors through DCP (``dcp/``, raw bytes:
  :mod:`raw_dcp`), small state as JSON, per-rank RNG tensors as raw bytes too
  (:mod:`tensor_file`); every byte hashed as it is written, every file fsynced.
  No file of a snapshot holds a pickle.
* **publish** — ranks agree everything is written; rank 0 writes and fsyncs the
  manifest and renames the temp dir into place (``store.publish``).

Loading reads only what the manifest lists, through loaders that run no code:
JSON and raw tensor bytes (older snapshots: the restricted DCP reader and
``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp

from ckptrun.runtime import collectives
from ckptrun.runtime.checkpoint import tensor_file, zip_crc
from ckptrun.runtime.checkpoint.dcp_io import SafeReader, allocate_from_metadata, load_metadata, tensor_table
from ckptrun.runtime.checkpoint.dcp_writer import hashing_writer
from ckptrun.runtime.checkpoint.node_planner import NodeShardPlanner
from ckptrun.runtime.checkpoint.raw_dcp import METADATA_JSON
from ckptrun.runtime.checkpoint.snapshot_types import (
    DCP_DIR, LEGACY, STATE_JSON, FaultHook, Loaded, LoadError, SaveResult, SnapshotInfo, State, rank_json, rank_tensors,
)
from ckptrun.runtime.checkpoint.verified_read import prefetch, read_small
from ckptrun.runtime.hashing import HashingWriter
from ckptrun.runtime.manifest import Chunk, FileEntry, Manifest, TensorEntry, is_data_file, read_manifest
from ckptrun.runtime.storage import store

# A world of one saves with DCP's no_dist (no collective to plan alone); DCP warns that it assumes a single
# process, which is exactly the case.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

__all__ = [  # the format's names and records live in snapshot_types; callers find them here too
    "DCP_DIR", "STATE_JSON", "FaultHook", "LoadError", "Loaded", "Manifest", "SaveResult", "SnapshotInfo", "State",
    "check_sizes", "load", "persist_and_publish", "rank_json", "rank_tensors", "read_manifest",
]


def persist_and_publish(
    temp_dir: Path,
    state: State,
    info: SnapshotInfo,
    algorithm: str,
    fault: FaultHook,
    group: Any = None,
    agree: Callable[[], SaveResult | None] | None = None,
) -> SaveResult:
    """Persist this rank's part of a staged snapshot, then publish it collectively on ``group``.

    Every rank gets the same result. Runs inline (sync saves) or on the
    background writer thread (async saves); it only reads the staged copies.
    ``agree`` (every rank, once every file is written and before anything is published): the ranks'
    verdict on the values; a refused result is returned as it is, unpublished.
    """
    started = time.monotonic()
    rank, world = collectives.rank(), collectives.world_size()  # files are tagged with the job's rank
    lead, members = collectives.rank(group) == 0, collectives.world_size(group)  # a node's own snapshot: its ranks
    entries, error, table = _persist_durably(temp_dir, state, rank, lead, algorithm, fault, group)
    persist_done = time.monotonic()
    gathered = _gather((entries, error, state.staged_bytes, state.allocated_bytes), members, group)
    staged = tuple(g[2] for g in gathered)
    allocated = tuple(g[3] for g in gathered)
    errors = ranks_said([(r, g[1]) for r, g in enumerate(gathered) if g[1]])
    if errors:
        errors.append(_free_space(temp_dir.parent))
        if lead:
            store.clean_temp_dirs(temp_dir.parent)
        if members > 1:
            collectives.barrier(group)
        return SaveResult(False, info.step, error="; ".join(errors), persist_s=persist_done - started)
    refused = agree() if agree is not None else None
    if refused is not None:
        return refused
    fault("before-manifest")
    result: Any = None
    if lead:
        files = sorted((e for g in gathered for e in g[0]), key=lambda e: e.path)
        result = _publish(temp_dir, files, table, info, world, fault)
    else:
        fault("before-publish")  # the publisher is the group's first rank; the others wait for it here
    if members > 1:
        result = collectives.broadcast_object(result, group=group)
    if isinstance(result, str):
        return SaveResult(False, info.step, error=result, persist_s=persist_done - started)
    path, total, digest = result
    return SaveResult(True, info.step, Path(path), total, 0.0, persist_done - started, time.monotonic() - persist_done,
                      staged_bytes_per_rank=staged, allocated_bytes_per_rank=allocated, tensor_digest=digest)


def _gather(obj: Any, world: int, group: Any) -> list[Any]:
    """Every rank's ``obj``; a world of one needs no collective."""
    return [obj] if world == 1 else collectives.all_gather_object(obj, group=group)


_durability = threading.local()  # the FsyncBatch of the save persisting on this thread, if any


def _persist_durably(temp_dir: Path, state: State, rank: int, lead: bool, algorithm: str, fault: FaultHook,
                     group: Any) -> tuple[list[FileEntry], str | None, dict[str, TensorEntry]]:
    """:func:`_persist`, with every file it wrote durable on return.

    DCP fsyncs its own files; the small files (:func:`_write_bytes`) and, on rank 0,
    ``dcp/`` itself (every rank's data file is in it once DCP returns) are fsynced
    side by side in one :class:`store.FsyncBatch` rather than one after another.
    """
    batch = store.FsyncBatch()
    _durability.batch = batch
    try:
        with zip_crc.skipped():  # the manifest digests cover every byte
            entries, error, table = _persist(temp_dir, state, rank, lead, algorithm, fault, group)
    finally:
        _durability.batch = None
    if lead and error is None:
        batch.directory(temp_dir / DCP_DIR)
    try:
        batch.wait()
    except OSError as exc:
        error = error or f"writing {exc.filename or 'snapshot file'} failed: {exc.strerror or exc}"
    return entries, error, table


def _persist(temp_dir: Path, state: State, rank: int, lead: bool, algorithm: str, fault: FaultHook,
             group: Any) -> tuple[list[FileEntry], str | None, dict[str, TensorEntry]]:
    """Write this rank's files (its share of the DCP state, tagged with its rank); DCP runs collectively,
    so every rank must call it. Also returns the global shape and dtype of every DCP tensor."""
    entries: list[FileEntry] = []
    error, table = None, {}
    writer = hashing_writer(temp_dir / DCP_DIR, algorithm, on_write=lambda name: fault("persist"), legacy=LEGACY.on)
    try:
        partial = group is not None and collectives.world_size(group) < collectives.world_size()  # a node's part
        metadata = dcp.save(state.shared_tensors, storage_writer=writer, process_group=group,
                            planner=NodeShardPlanner() if partial else None,
                            no_dist=collectives.world_size(group) == 1)  # a world of one plans alone: no collectives
        table = {key: TensorEntry(shape=shape, dtype=dtype) for key, (shape, dtype) in tensor_table(metadata).items()}
    except BaseException as exc:  # CheckpointException is a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        error = f"DCP save failed: {_first_line(exc)}"
    entries += [FileEntry(path=f"{DCP_DIR}/{name}", size=size, algorithm=algorithm, digest=digest, rank=rank,
                          chunks=None if chunks is None else [Chunk(offset=o, length=n, digest=d) for o, n, d in chunks])
                for name, (size, digest, chunks) in writer.fs.digests.items()]
    if error:
        return entries, error, table
    try:
        if lead:  # the group's first rank (the job's rank 0, or a node's first for a node's own snapshot)
            entries.append(_write_json(temp_dir / STATE_JSON, state.shared_tree, algorithm))
        entries.append(_write_json(temp_dir / rank_json(rank), state.rank_tree, algorithm))
        entries.append(_write_tensors(temp_dir / rank_tensors(rank, LEGACY.on), state.rank_tensors, algorithm))
    except OSError as exc:
        error = f"writing {exc.filename or 'snapshot file'} failed: {exc.strerror or exc}"
    return [e.model_copy(update={"rank": rank}) for e in entries], error, table


def _free_space(ckpt_dir: Path) -> str:
    """Disk-full errors often surface as obscure serialiser errors; say how much room there is."""
    try:
        return f"{shutil.disk_usage(ckpt_dir).free / 2**20:.0f} MiB free in {ckpt_dir}"
    except OSError:
        return f"{ckpt_dir} is not accessible"


ERROR_CHARS = 240  # one rank's cause, as a person reads it in a line (the event keeps no more either)


def ranks_said(errors: list[tuple[int, str]]) -> list[str]:
    """Each distinct error once, with the ranks that raised it (``ranks 0, 1: …``), cut to a line's length:
    every rank of a node raising the same 500-character planner error once said it once per rank."""
    by_text: dict[str, list[int]] = {}
    for rank, text in errors:
        by_text.setdefault(text if len(text) <= ERROR_CHARS else text[:ERROR_CHARS - 1] + "…", []).append(rank)
    return [f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {text}" for text, ranks in by_text.items()]


def _first_line(exc: BaseException) -> str:
    """A one-line cause, digging into DCP's per-rank failures."""
    failures = getattr(exc, "failures", None)
    if failures:
        exc = next(iter(failures.values()))
        exc = exc[0] if isinstance(exc, tuple) else exc
    text = f"{type(exc).__name__}: {exc}".strip()
    for marker in ("No space left", "Errno", "Permission denied"):
        index = text.find(marker)
        if index >= 0:
            return text[index:].splitlines()[0][:300]
    return text.splitlines()[0][:300]


def _write_json(path: Path, tree: Any, algorithm: str) -> FileEntry:
    data = json.dumps(tree, sort_keys=True, allow_nan=True).encode()
    return _write_bytes(path, lambda stream: stream.write(data), algorithm)


def _write_tensors(path: Path, tensors: dict[str, torch.Tensor], algorithm: str) -> FileEntry:
    if path.suffix == ".pt":  # the format before raw tensor files (tests make such snapshots)
        return _write_bytes(path, lambda stream: torch.save(tensors, stream), algorithm)
    return _write_bytes(path, lambda stream: [stream.write(piece) for piece in tensor_file.encode(tensors)], algorithm)


def _write_bytes(path: Path, write: Callable[[Any], Any], algorithm: str) -> FileEntry:
    """Write, hash and fsync one small file; inside :func:`_persist_durably` the fsync joins the
    save's batch (awaited before the results are gathered), elsewhere it runs here."""
    batch: store.FsyncBatch | None = getattr(_durability, "batch", None)
    stream = HashingWriter(open(path, "wb"), algorithm)
    try:
        write(stream)
        stream.flush()
    except BaseException:
        stream.close()
        raise
    if batch is None:
        with stream:
            os.fsync(stream.fileno())
    else:
        batch.file(stream, path)  # the batch closes it
    return FileEntry(path=path.name, size=stream.size, algorithm=algorithm, digest=stream.hexdigest())


def _publish(temp_dir: Path, files: list[FileEntry], tensors: dict[str, TensorEntry], info: SnapshotInfo, world: int,
             fault: FaultHook) -> tuple[str, int, str] | str:
    """Rank 0: manifest last, then the atomic rename. Returns (path, bytes, tensor digest) or an error."""
    manifest = Manifest(
        run_id=info.run_id, lineage=info.lineage, parent=info.parent, step=info.step, epoch=info.epoch,
        samples_seen=info.samples_seen, world_size=world, precision=info.precision, config=info.config,
        torch_version=torch.__version__, code_version=info.code_version, files=files, tensors=tensors,
        world_size_history=info.world_size_history,
    )
    try:
        store.write_manifest(temp_dir, manifest)  # dcp/ was fsynced with the files (_persist_durably)
        fault("before-publish")
        final = store.publish(temp_dir, info.step)
    except OSError as exc:
        store.clean_temp_dirs(temp_dir.parent)
        return f"publishing {store.snapshot_name(info.step)} failed: {exc.strerror or exc}"
    return str(final), manifest.total_bytes, _tensor_digest(files)


def _tensor_digest(files: list[FileEntry]) -> str:
    """One digest over the DCP data files' digests and the ranks' own tensors (per-rank state, RNG), not the
    metadata, which names the save."""
    data = [f"{f.path}:{f.digest}" for f in files if is_data_file(f.path) or f.path.startswith("rank-")
            and not f.path.endswith(".json")]
    return hashlib.sha256("\n".join(sorted(data)).encode()).hexdigest()


# --- loading -------------------------------------------------------------------


def check_sizes(snapshot_dir: Path, manifest: Manifest) -> None:
    """Cheap pre-load check: digests are checked as the bytes are read (chunked manifests) or were checked
    whole before the load (older ones)."""
    for entry in manifest.files:
        path = snapshot_dir / entry.path
        if not path.resolve().is_relative_to(snapshot_dir.resolve()):
            raise LoadError(f"{entry.path} leaves the snapshot directory")
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise LoadError(f"{snapshot_dir.name}/{entry.path} is missing") from None
        if size != entry.size:
            raise LoadError(f"{snapshot_dir.name}/{entry.path} is {size} bytes, manifest says {entry.size}")


def load(snapshot_dir: Path, rank_files: bool = True, live: dict[str, torch.Tensor] | None = None) -> Loaded:
    """Collectively load a snapshot; every rank reads its own files, each byte once.

    With a chunked (schema 3) manifest every byte read is hashed as it is read and checked against the
    manifest before it is parsed: small files whole, each DCP item by the digest of exactly its bytes.
    Older manifests are loaded as verified beforehand (``verify_snapshot`` hashes their whole files).

    Tensors in ``live`` (model and optimizer, keyed as stored) are loaded into in place, so
    each rank reads only its shards; tied tensors come back as one tensor under every key.

    ``rank_files=False`` (a resume at another world size) reads no per-rank files: ``rank_tree`` is empty.

    Raises :class:`LoadError` on every rank when any rank cannot load its part (a digest that does not
    match included: the message names the rank, the file, the byte range and the tensor), so the ranks
    agree on falling back instead of deadlocking.
    """
    read: tuple[Loaded, SafeReader] | None = None
    problem = None
    try:
        read = _read_local(snapshot_dir, collectives.rank(), rank_files, live)
    except Exception as exc:  # noqa: BLE001 - any local failure must reach the agreement below
        problem = f"rank {collectives.rank()}: {type(exc).__name__}: {exc}"
    problems = [p for p in collectives.all_gather_object(problem) if p]
    if problems or read is None:
        raise LoadError("; ".join(problems[:2]) if problems else "nothing loaded")
    local, reader = read
    if local.shared_tensors:
        try:
            dcp.load(local.shared_tensors, storage_reader=reader)
        except BaseException as exc:  # CheckpointException is a BaseException, raised on every rank
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise LoadError(f"DCP load failed: {_rank_failures(exc)}") from None
    for alias, key in local.shared_tree.get("aliases", {}).items():
        local.shared_tensors[alias] = local.shared_tensors[key]
    return local


def _rank_failures(exc: BaseException) -> str:
    """Every failing rank's cause, one line each (DCP gathers them into one exception on every rank)."""
    failures = getattr(exc, "failures", None)
    if not failures:
        return f"rank {collectives.rank()}: {_first_line(exc)}"
    causes = []
    for rank, failure in sorted(failures.items()):
        cause = failure[0] if isinstance(failure, tuple) else failure
        causes.append(f"rank {rank}: {_first_line(cause)}")
    return "; ".join(causes[:3]) + (f" (and {len(causes) - 3} more ranks)" if len(causes) > 3 else "")


def _read_local(snapshot_dir: Path, rank: int, rank_files: bool = True,
                live: dict[str, torch.Tensor] | None = None) -> tuple[Loaded, SafeReader]:
    """This rank's small files and the DCP metadata, each read once (and checked against its digest when the
    manifest is chunked) and parsed by loaders that run no code; the reader for its DCP items."""
    from ckptrun.runtime.checkpoint.treecodec import tensor_keys

    manifest = read_manifest(snapshot_dir)
    check_sizes(snapshot_dir, manifest)
    listed = {entry.path: entry for entry in manifest.files}
    legacy = f"{DCP_DIR}/{METADATA_JSON}" not in listed  # written before raw tensor files
    tensors_file = rank_tensors(rank, legacy)
    own_files = (rank_json(rank), tensors_file) if rank_files else ()
    metadata_file = f"{DCP_DIR}/.metadata" if legacy else f"{DCP_DIR}/{METADATA_JSON}"
    for needed in (STATE_JSON, *own_files, metadata_file):
        if needed not in listed:
            raise LoadError(f"{snapshot_dir.name} does not list {needed}")
    prefetch([snapshot_dir / name for name in (STATE_JSON, *own_files, metadata_file)])

    def read(name: str) -> bytes:
        return read_small(snapshot_dir, listed[name], manifest.verified_as_loaded)

    shared_tree = json.loads(read(STATE_JSON))
    rank_tree: dict[str, Any] = json.loads(read(rank_json(rank))) if rank_files else {}
    own = _read_tensors(read(tensors_file), legacy, tensors_file) if rank_files else {}
    metadata = load_metadata(snapshot_dir / DCP_DIR, manifest)
    _check_tensor_table(manifest, tensor_table(metadata))
    aliases = shared_tree.get("aliases", {})
    shared = allocate_from_metadata(metadata, [k for k in tensor_keys(shared_tree) if k not in aliases], live)
    fresh = [key for key, tensor in shared.items() if (live or {}).get(key) is not tensor]
    reader = SafeReader(snapshot_dir / DCP_DIR, manifest, metadata, fresh)
    return Loaded(manifest, shared_tree, shared, rank_tree, own), reader


def _read_tensors(data: bytes, legacy: bool, name: str) -> dict[str, torch.Tensor]:
    """A rank's own tensors: raw tensor bytes, or (older snapshots) ``torch.load`` weights-only."""
    try:
        own = (torch.load(io.BytesIO(data), map_location="cpu", weights_only=True) if legacy
               else tensor_file.decode(bytearray(data)))
    except tensor_file.TensorFileError as exc:
        raise LoadError(f"{name}: {exc}") from None
    if not isinstance(own, dict) or not all(isinstance(v, torch.Tensor) for v in own.values()):
        raise LoadError(f"{name} does not hold a dict of tensors")
    return own


def _check_tensor_table(manifest: Manifest, stored: dict[str, tuple[list[int], str]]) -> None:
    """The DCP metadata describes exactly the tensors the manifest lists (schema 2), shape for shape."""
    if manifest.schema_version < 2:
        return
    listed = {key: (entry.shape, entry.dtype) for key, entry in manifest.tensors.items()}
    for key in sorted(set(listed) | set(stored)):
        if listed.get(key) != stored.get(key):
            raise LoadError(f"tensor {key!r}: manifest says {listed.get(key)}, DCP metadata says {stored.get(key)}")
