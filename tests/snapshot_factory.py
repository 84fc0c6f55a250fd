"""Synthetic snapshots for tests, built through runtime.storage.store without torch.

The files are arbitrary bytes: what matters to verify, retention and lineage is
the manifest and the directory layout, not what the tensors mean. ``save_state``
is the exception: a real snapshot of a given state, through the runtime's saver
(it imports torch when called).
"""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import ckptrun.runtime.storage.store as store
from ckptrun.runtime.hashing import chunks_digest, hash_file
from ckptrun.runtime.manifest import MANIFEST_NAME, Chunk, FileEntry, Manifest, TensorEntry, read_manifest

RUN_ID = "test-run"


def default_files(step: int) -> dict[str, bytes]:
    return {
        "model.bin": bytes(range(256)) * 8 + step.to_bytes(8, "little"),
        "optim.bin": bytes(1000) + step.to_bytes(8, "little"),
        "rank0/rng.json": json.dumps({"step": step, "seed": 0}).encode(),
    }


def make_snapshot(
    ckpt_dir: Path,
    step: int,
    files: dict[str, bytes] | None = None,
    run_id: str = RUN_ID,
    parent: str | None = None,
) -> Path:
    """Write, hash and publish a snapshot of the current lineage at ``step``."""
    lineage = store.ensure_lineage(ckpt_dir, run_id)
    temp = store.new_temp_dir(ckpt_dir, step)
    entries = [_write(temp, rel, data) for rel, data in (files or default_files(step)).items()]
    manifest = Manifest(run_id=run_id, lineage=lineage.current, parent=parent, step=step, world_size=1, files=entries)
    store.write_manifest(temp, manifest)
    return store.publish(temp, step)


def make_chunked_snapshot(ckpt_dir: Path, step: int, parent: str | None = None, chunk: int = 512,
                          data: bytes = bytes(range(256)) * 16) -> Path:
    """A snapshot whose DCP data file (``data``) has chunk digests (schema 3): a pre-load check of it reads sizes
    only, because the loader hashes every chunk it reads (``Manifest.verified_as_loaded``)."""
    path = make_snapshot(ckpt_dir, step, {**default_files(step), "dcp/__0_0.safetensors": data}, parent=parent)
    manifest = read_manifest(path)
    entries = []
    for entry in manifest.files:
        if entry.path.startswith("dcp/") and entry.path.endswith(".safetensors"):
            data = (path / entry.path).read_bytes()
            chunks = [Chunk(offset=o, length=min(chunk, len(data) - o),
                            digest=hashlib.sha256(data[o:o + chunk]).hexdigest()) for o in range(0, len(data), chunk)]
            entry = entry.model_copy(update={"chunks": chunks, "digest": chunks_digest(
                "sha256", ((c.offset, c.length, c.digest) for c in chunks))})
        entries.append(entry)
    tensors = {"w": TensorEntry(shape=[1024], dtype="float32")}
    (path / MANIFEST_NAME).write_text(manifest.model_copy(update={"files": entries, "tensors": tensors}).model_dump_json())
    assert read_manifest(path).verified_as_loaded
    return path


def save_state(ckpt_dir: Path, state: object, step: int, lineage_name: str, legacy: bool = False) -> Path:
    """A real snapshot of ``state`` (a ``snapshot.State``) written by the runtime's sync saver in this process
    (``legacy``: in the format before raw tensor files, ``torch.save`` items and a pickled ``.metadata``)."""
    from ckptrun.runtime.checkpoint import snapshot
    from ckptrun.runtime.checkpoint.saver import Saver

    lineage = store.ensure_lineage(ckpt_dir, lineage_name)
    info = snapshot.SnapshotInfo(lineage_name, lineage.current, None, step, 0, 0, "fp32", {}, "")
    results: list[snapshot.SaveResult] = []
    snapshot.LEGACY.on = legacy
    try:
        Saver(ckpt_dir, "sha256", asynchronous=False).begin(state, info, lambda phase: None, results.append)
    finally:
        snapshot.LEGACY.on = False
    assert results[0].ok, results[0].error
    return results[0].path


def make_temp_dir(ckpt_dir: Path, step: int, suffix: str = "abc123") -> Path:
    """A save in progress, named like store.new_temp_dir names one."""
    path = ckpt_dir / f".{store.snapshot_name(step)}.tmp-{suffix}"
    path.mkdir(parents=True)
    (path / "model.bin").write_bytes(b"partial")
    return path


def _write(root: Path, rel: str, data: bytes) -> FileEntry:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    size, digest = hash_file(path, "sha256")
    return FileEntry(path=rel, size=size, algorithm="sha256", digest=digest, rank=0)  # a one-rank job wrote it


# --- damage, as disks and people do it -----------------------------------------


def flip_byte(path: Path, offset: int | None = None) -> None:
    """Invert one byte (the middle one by default): the size stays, the digest does not."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if offset is None else offset] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path, keep: int = 5) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def manifest_dict(snapshot: Path) -> dict:
    return json.loads((snapshot / MANIFEST_NAME).read_text())


def write_manifest_dict(snapshot: Path, document: dict) -> None:
    """Overwrite the manifest with a raw document (bypassing validation on purpose)."""
    (snapshot / MANIFEST_NAME).write_text(json.dumps(document))


class Exploit:
    """Unpickling this runs code that creates a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",))


def plant_pickle(snapshot: Path, relative: str, marker: Path) -> None:
    """Replace a file with a malicious pickle and update the manifest so that the digests match."""
    target = snapshot / relative
    target.write_bytes(pickle.dumps(Exploit(marker)))
    size, digest = hash_file(target, "sha256")
    document = manifest_dict(snapshot)
    next(f for f in document["files"] if f["path"] == relative).update(size=size, digest=digest)
    write_manifest_dict(snapshot, document)
