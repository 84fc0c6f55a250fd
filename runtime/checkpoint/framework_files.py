"""A framework's own checkpoints, published with a ckptrun manifest so that they can be trusted.

Lightning writes one ``.ckpt`` file per checkpoint, Hugging Face's ``Trainer`` one ``checkpoint-N``
directory. Neither fsyncs, and a kill mid-write leaves a file that looks whole. The integrations
(:mod:`ckptrun.integrations`) publish them the way a snapshot is published (contract C2): every file is
fsynced, then a :class:`~ckptrun.runtime.manifest.FrameworkManifest` with each file's size and digest is
written to a temp name, fsynced and renamed into place, last. A checkpoint without a valid manifest does not
exist as far as ckptrun is concerned: :func:`newest_verified` skips it, and ``ckptrun verify`` reports it.

Layout: a file ``X`` gets the sidecar ``X.ckptrun.json`` beside it; a directory ``D`` gets
``D/ckptrun-manifest.json``. Importable without torch.
"""

from __future__ import annotations

import os
import shutil
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ckptrun.runtime.hashing import hash_file
from ckptrun.runtime.manifest import (DIRECTORY_MANIFEST, SIDECAR_SUFFIX, FileEntry, FrameworkManifest,
                                      ManifestError, read_framework_manifest)
from ckptrun.runtime.storage.store import fsync_dir

ALGORITHM = "sha256"


@dataclass(frozen=True)
class Published:
    """One framework checkpoint with a manifest: ``path`` is what the framework loads (file or directory)."""

    path: Path
    manifest_path: Path

    @property
    def root(self) -> Path:
        """The directory the manifest's file paths are relative to."""
        return self.path if self.path.is_dir() else self.path.parent


def manifest_path_of(checkpoint: Path) -> Path:
    """Where the manifest of ``checkpoint`` (a file or a directory) lives."""
    return checkpoint / DIRECTORY_MANIFEST if checkpoint.is_dir() else checkpoint.with_name(checkpoint.name + SIDECAR_SUFFIX)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _entry(root: Path, path: Path) -> FileEntry:
    size, digest = hash_file(path, ALGORITHM)
    return FileEntry(path=path.relative_to(root).as_posix(), size=size, algorithm=ALGORITHM, digest=digest)


def _files_of(checkpoint: Path) -> list[Path]:
    if not checkpoint.is_dir():
        return [checkpoint]
    return sorted(p for p in checkpoint.rglob("*") if p.is_file() and p.name != DIRECTORY_MANIFEST
                  and not p.name.startswith(".ckptrun-"))


def publish(checkpoint: Path, framework: str, run_id: str, step: int) -> Path:
    """fsync every file of ``checkpoint``, then commit its manifest (temp, fsync, rename, fsync the directory).
    Returns the manifest's path."""
    root = checkpoint if checkpoint.is_dir() else checkpoint.parent
    files = _files_of(checkpoint)
    for path in files:
        _fsync_file(path)
    for folder in sorted({p.parent for p in files}, key=lambda p: len(p.parts), reverse=True):
        fsync_dir(folder)
    manifest = FrameworkManifest(framework=framework, run_id=run_id, step=step,
                                 files=[_entry(root, path) for path in files])
    target = manifest_path_of(checkpoint)
    temp = target.with_name(f".ckptrun-{uuid.uuid4().hex[:8]}.tmp")
    with open(temp, "w") as stream:
        stream.write(manifest.model_dump_json(indent=1))
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(temp, target)
    fsync_dir(target.parent)
    return target


def place_file(temp: Path, final: Path) -> None:
    """Move a fully written file into place atomically (fsync, rename, fsync the directory); its manifest
    follows with :func:`publish`, so a crash in between leaves a file that is not published."""
    _fsync_file(temp)
    os.replace(temp, final)
    fsync_dir(final.parent)


def remove(checkpoint: Path) -> None:
    """Unpublish first (the manifest goes), then delete: a half-deleted checkpoint is never trusted."""
    manifest_path_of(checkpoint).unlink(missing_ok=True)
    if checkpoint.is_dir():
        shutil.rmtree(checkpoint, ignore_errors=True)
    else:
        checkpoint.unlink(missing_ok=True)


def find(root: Path) -> list[Published]:
    """Every checkpoint under ``root`` (one level) that has a manifest file, published or not yet checked."""
    if not root.is_dir():
        return []
    found = []
    for child in sorted(root.iterdir()):
        if child.is_dir() and (child / DIRECTORY_MANIFEST).is_file():
            found.append(Published(child, child / DIRECTORY_MANIFEST))
        elif child.name.endswith(SIDECAR_SUFFIX) and not child.name.startswith("."):
            found.append(Published(child.with_name(child.name[:-len(SIDECAR_SUFFIX)]), child))
    return found


def unpublished(root: Path) -> list[Path]:
    """Checkpoints a framework wrote that carry no manifest (a kill before the commit, or written outside ckptrun)."""
    if not root.is_dir():
        return []
    published = {p.path for p in find(root)}
    return sorted(c for c in root.iterdir() if c not in published and not c.name.startswith(".")
                  and not c.name.endswith(SIDECAR_SUFFIX) and (c.suffix == ".ckpt" or c.name.startswith("checkpoint-")))


def check(published: Published, sizes_only: bool = False) -> tuple[FrameworkManifest | None, str | None]:
    """The manifest and the first problem (None: every file has its size and digest)."""
    try:
        manifest = read_framework_manifest(published.manifest_path)
    except ManifestError as exc:
        return None, str(exc)
    for entry in manifest.files:
        path = published.root / entry.path
        try:
            size = path.stat().st_size
        except OSError:
            return manifest, f"{entry.path}: missing"
        if size != entry.size:
            return manifest, f"{entry.path}: {size} bytes, the manifest says {entry.size}"
        if not sizes_only and hash_file(path, entry.algorithm)[1] != entry.digest:
            return manifest, f"{entry.path}: digest mismatch (the bytes changed after it was written)"
    return manifest, None


def newest_verified(root: Path, say: Callable[[str], None] | None = None) -> tuple[Path, int] | None:
    """The newest (by global step) checkpoint under ``root`` whose bytes match its manifest; each newer one
    that does not is named through ``say`` (stderr by default) and skipped."""
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    candidates = []
    for published in find(root):
        try:
            candidates.append((read_framework_manifest(published.manifest_path).step, published))
        except ManifestError as exc:
            say(f"ckptrun: skipping {published.path.name}: {exc}")
    for step, published in sorted(candidates, key=lambda c: (c[0], c[1].manifest_path.stat().st_mtime), reverse=True):
        _, problem = check(published)
        if problem is None:
            return published.path, step
        say(f"ckptrun: skipping checkpoint {published.path.name} (step {step}): {problem}; trying an older one")
    return None


def report(root: Path, sizes_only: bool = False) -> list[dict[str, object]]:
    """``ckptrun verify`` of a framework's checkpoint directory: one verdict per checkpoint (``ok``,
    ``corrupt``, ``incomplete``: its manifest is unreadable; ``unpublished``: written but never committed,
    a kill mid-save, and not trusted — it does not fail the check)."""
    verdicts: list[dict[str, object]] = []
    for published in find(root):
        manifest, problem = check(published, sizes_only)
        verdicts.append({"path": str(published.path), "step": manifest.step if manifest else None,
                         "framework": manifest.framework if manifest else None,
                         "files": len(manifest.files) if manifest else 0,
                         "bytes": sum(e.size for e in manifest.files) if manifest else 0,
                         "status": "ok" if problem is None else "corrupt" if manifest else "incomplete",
                         "problems": [problem] if problem else []})
    for path in unpublished(root):
        verdicts.append({"path": str(path), "step": None, "framework": None, "files": 0, "bytes": 0,
                         "status": "unpublished", "problems": ["no ckptrun manifest: never committed, not trusted"]})
    return sorted(verdicts, key=lambda v: (v["step"] is None, v["step"] or 0))
