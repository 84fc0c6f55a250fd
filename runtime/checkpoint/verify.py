"""Checking snapshots against their manifests: the one place that says a snapshot is good.

Used by ``ckptrun verify``, by the supervisor before a relaunch and by the
runtime under plain torchrun. Files are hashed in parallel threads (hashlib
releases the GIL on large buffers). Importable without torch.

Who hashes what: every byte loaded is verified once. ``ckptrun verify`` hashes
whole files (a chunked file chunk by chunk, :func:`hashing.entry_hasher`).
Before a load, ``at_load=True`` checks only the manifest and sizes when the
manifest is chunked (schema 3), because the loader then hashes every byte it
reads (:mod:`verified_read`); older manifests are hashed whole there.
"""

from __future__ import annotations

import os
import time
from stat import S_ISREG
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ckptrun.runtime.hashing import entry_hasher, feed_file
from ckptrun.runtime.manifest import MANIFEST_NAME, FileEntry, Manifest, ManifestError, read_manifest
from ckptrun.runtime.storage.store import Entry, Lineage, list_entries, read_lineage

if TYPE_CHECKING:
    from ckptrun.runtime.storage.remote_store import FsspecStore, Prefix

OK, CORRUPT, INCOMPLETE, IN_PROGRESS, VANISHED = "ok", "corrupt", "incomplete", "in-progress", "vanished"


@dataclass
class SnapshotReport:
    """The verdict on one snapshot directory."""

    path: Path | str  # a local directory, or the URL of an object-store prefix
    step: int
    status: str
    problems: list[str] = field(default_factory=list)
    manifest: Manifest | None = None
    abandoned: bool = False
    deferred: bool = False  # only manifest and sizes checked: the load verifies every byte it reads

    @property
    def checked(self) -> str:
        """What this verdict rests on, in words for logs and events."""
        return "manifest and sizes checked; digests verified as loaded" if self.deferred else "every digest checked"

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def files(self) -> int:
        return len(self.manifest.files) if self.manifest else 0

    @property
    def bytes(self) -> int:
        return self.manifest.total_bytes if self.manifest else 0

    def to_json(self) -> dict:
        return {
            "path": str(self.path),
            "step": self.step,
            "status": self.status,
            "problems": self.problems,
            "lineage": self.manifest.lineage if self.manifest else None,
            "abandoned": self.abandoned,
            "files": self.files,
            "bytes": self.bytes,
            "created": self.manifest.created if self.manifest else None,
        }


def default_threads() -> int:
    return max(2, min(8, os.cpu_count() or 2))


def _check_file(root: Path, entry: FileEntry, quick: bool, progress: Callable[[int], None] | None,
                uncached: bool = False) -> str | None:
    """A problem with one listed file, or None when it matches."""
    path = root / entry.path
    if not path.resolve().is_relative_to(root.resolve()):
        return f"{entry.path}: leaves the snapshot directory"
    try:
        stat = path.stat()
    except FileNotFoundError:
        return f"{entry.path}: missing"
    except OSError as exc:
        return f"{entry.path}: unreadable ({exc.strerror or exc})"
    if not S_ISREG(stat.st_mode):
        return f"{entry.path}: not a regular file"
    size = stat.st_size
    if size != entry.size:
        return f"{entry.path}: size {size} bytes, manifest says {entry.size}"
    if quick:
        return None
    try:
        hasher = entry_hasher(entry)
        feed_file(path, hasher, progress, uncached)
    except ValueError as exc:
        return f"{entry.path}: {exc}"
    except OSError as exc:
        return f"{entry.path}: unreadable ({exc.strerror or exc})"
    bad = hasher.bad_chunks() if entry.chunks is not None else []
    if bad:
        (chunk, found), more = bad[0], f" (and {len(bad) - 1} more chunks)" if len(bad) > 1 else ""
        return (f"{entry.path}: {entry.algorithm} {found[:16]}… of bytes {chunk.offset}..{chunk.offset + chunk.length}, "
                f"manifest says {chunk.digest[:16]}…{more}")
    digest = hasher.hexdigest()
    if digest != entry.digest:
        return f"{entry.path}: {entry.algorithm} {digest[:16]}…, manifest says {entry.digest[:16]}…"
    return None


def _unlisted(root: Path, manifest: Manifest) -> list[str]:
    """Files in the snapshot the manifest does not name; none when retention deletes it under the walk
    (the caller then sees the directory gone and reports it vanished, not corrupt)."""
    listed = {entry.path for entry in manifest.files} | {MANIFEST_NAME}
    try:
        found = {str(p.relative_to(root).as_posix()) for p in root.rglob("*") if p.is_file()}
    except FileNotFoundError:
        return []
    return sorted(found - listed)


def verify_snapshot(
    path: Path,
    quick: bool = False,
    progress: Callable[[int], None] | None = None,
    pool: ThreadPoolExecutor | None = None,
    uncached: bool = False,
    share: tuple[int, int] = (0, 1),
    at_load: bool = False,
    manifest: Manifest | None = None,
) -> SnapshotReport:
    """Check one snapshot: manifest valid, every file present, right size and (unless quick) digest,
    read past the page cache with ``uncached``. ``share=(i, n)``: only the listed files i, i+n, i+2n… (one
    node's part of a verify spread over n nodes; share 0 also looks for unlisted files). ``at_load``: the
    check before a load, which leaves the digests of a chunked manifest to the loader (``report.deferred``).
    ``manifest``: the one the caller read from ``path`` already."""
    step = _step_of(path)
    if not path.exists():
        return SnapshotReport(path, step, VANISHED, ["deleted while verifying (retention)"])
    try:
        manifest = manifest or read_manifest(path)
    except ManifestError as exc:
        if not path.exists():
            return SnapshotReport(path, step, VANISHED, ["deleted while verifying (retention)"])
        status = INCOMPLETE if "missing" in str(exc) else CORRUPT
        return SnapshotReport(path, step, status, [str(exc)])
    report = SnapshotReport(path, step, OK, manifest=manifest, deferred=at_load and manifest.verified_as_loaded)
    quick = quick or report.deferred
    if manifest.step != step and step >= 0:
        report.problems.append(f"manifest step {manifest.step} does not match directory name {path.name}")
    own_pool = pool is None
    pool = pool or ThreadPoolExecutor(default_threads())
    try:
        mine = manifest.files[share[0]::share[1]]
        results = list(pool.map(lambda e: _check_file(path, e, quick, progress, uncached), mine))
    finally:
        if own_pool:
            pool.shutdown()
    report.problems += [problem for problem in results if problem]
    report.problems += [f"{name}: not listed in the manifest" for name in (_unlisted(path, manifest) if share[0] == 0 else [])]
    report.problems += manifest.sharding_problems()
    if not path.exists():
        return SnapshotReport(path, step, VANISHED, ["deleted while verifying (retention)"], manifest)
    if report.problems:
        missing_only = all(p.endswith(": missing") for p in report.problems)
        report.status = INCOMPLETE if missing_only else CORRUPT
    return report


def _step_of(path: Path) -> int:
    name = path.name.lstrip(".")
    try:
        return int(name.split("-")[1].split(".")[0])
    except (IndexError, ValueError):
        return -1


def verify_dir(
    ckpt_dir: Path,
    quick: bool = False,
    progress: Callable[[int], None] | None = None,
    threads: int | None = None,
) -> list[SnapshotReport]:
    """Reports for every published, abandoned and in-progress snapshot, oldest first."""
    lineage = read_lineage(ckpt_dir)
    reports = []
    with ThreadPoolExecutor(threads or default_threads()) as pool:
        for entry in list_entries(ckpt_dir):
            reports.append(report_entry(entry, lineage, quick, progress, pool))
    return reports


def report_entry(
    entry: Entry, lineage: Lineage | None, quick: bool, progress: Callable[[int], None] | None, pool: ThreadPoolExecutor
) -> SnapshotReport:
    """The verdict on one listed entry: in-progress temp dirs are not verified; abandoned ones are marked."""
    if entry.kind == "temp":
        return SnapshotReport(entry.path, entry.step, IN_PROGRESS, ["save in progress or interrupted (not published)"])
    report = verify_snapshot(entry.path, quick, progress, pool)
    outside = report.manifest is not None and lineage is not None and not lineage.contains(report.manifest)
    report.abandoned = entry.kind == "abandoned" or outside
    return report


def bytes_to_verify(ckpt_dir: Path) -> int:
    """Total listed bytes of published snapshots, for a progress bar's total."""
    total = 0
    for entry in list_entries(ckpt_dir):
        if entry.kind != "temp":
            try:
                total += read_manifest(entry.path).total_bytes
            except ManifestError:
                pass
    return total


def newest_verified(
    ckpt_dir: Path, log: Callable[[str], None] = lambda _: None, skip: set[str] | frozenset[str] = frozenset(),
    at_load: bool = False,
) -> SnapshotReport | None:
    """The newest snapshot of the current lineage that verifies, saying why newer ones were skipped.

    ``skip`` names snapshots already known not to load (they verified but were refused at load).
    ``at_load``: chosen for a load, which verifies chunked snapshots itself (see :func:`verify_snapshot`).
    """
    lineage = read_lineage(ckpt_dir)
    candidates = [e for e in list_entries(ckpt_dir, include_abandoned=False) if e.kind == "published" and e.name not in skip]
    with ThreadPoolExecutor(default_threads()) as pool:
        for entry in sorted(candidates, key=lambda e: e.step, reverse=True):
            started = time.monotonic()
            report = verify_snapshot(entry.path, pool=pool, at_load=at_load)
            if report.ok and lineage is not None and report.manifest and not lineage.contains(report.manifest):
                log(f"skipping {entry.name}: not in the current lineage")
                continue
            if report.ok:
                seconds = time.monotonic() - started
                log(f"using {entry.name}: {report.bytes} bytes, {report.checked} in {seconds:.2f}s" if report.deferred
                    else f"using {entry.name}: verified {report.bytes} bytes in {seconds:.2f}s")
                return report
            log(f"skipping {entry.name} ({report.status}): {'; '.join(report.problems[:3])}")
    return None


# --- object stores ---------------------------------------------------------------


def verify_remote(remote: "FsspecStore", name: str, quick: bool = False, progress: Callable[[int], None] | None = None,
                  prefixes: "list[Prefix] | None" = None, pool: ThreadPoolExecutor | None = None) -> SnapshotReport:
    """Check one ``step-<N>-<id>/`` prefix: a manifest (the commit), every listed object present with its
    size (from the listing) and, unless ``quick``, streamed and hashed to its digest; nothing unlisted."""
    from ckptrun.runtime.storage.remote_store import PREFIX_RE
    from ckptrun.runtime.storage.transfer import hash_object

    listing = {p.name: p for p in (remote.prefixes() if prefixes is None else prefixes)}
    where, match = remote.location(name), PREFIX_RE.match(name)
    step, prefix = int(match.group(1)) if match else -1, listing.get(name)
    if prefix is None:
        return SnapshotReport(where, step, VANISHED, ["deleted while verifying (retention)"])
    if not prefix.committed:
        return SnapshotReport(where, step, IN_PROGRESS, ["no manifest: an upload in progress or interrupted (not published)"])
    try:
        manifest = remote.read_manifest(name)
    except ManifestError as exc:
        return SnapshotReport(where, step, CORRUPT, [str(exc)])
    report = SnapshotReport(where, step, OK, manifest=manifest)
    if manifest.step != step:
        report.problems.append(f"manifest step {manifest.step} does not match prefix {name}")

    def check(entry: FileEntry) -> str | None:
        size = prefix.objects.get(entry.path)
        if size is None:
            return f"{entry.path}: missing"
        if size != entry.size:
            return f"{entry.path}: size {size} bytes, manifest says {entry.size}"
        if quick:
            return None
        try:
            size, digest = hash_object(remote, name, entry, progress)
        except Exception as exc:  # noqa: BLE001 - any storage error makes the object unreadable
            return f"{entry.path}: unreadable ({type(exc).__name__}: {str(exc)[:120]})"
        if size != entry.size or digest != entry.digest:
            return f"{entry.path}: {entry.algorithm} {digest[:16]}…, manifest says {entry.digest[:16]}…"
        return None

    own_pool = pool is None
    pool = pool or ThreadPoolExecutor(default_threads())
    try:
        report.problems += [problem for problem in pool.map(check, manifest.files) if problem]
    finally:
        if own_pool:
            pool.shutdown()
    listed = {entry.path for entry in manifest.files} | {MANIFEST_NAME}
    report.problems += [f"{extra}: not listed in the manifest" for extra in sorted(set(prefix.objects) - listed)]
    report.problems += manifest.sharding_problems()
    if report.problems:
        report.status = INCOMPLETE if all(p.endswith(": missing") for p in report.problems) else CORRUPT
    return report


def verify_remote_dir(remote: "FsspecStore", quick: bool = False, progress: Callable[[int], None] | None = None,
                      threads: int | None = None) -> list[SnapshotReport]:
    """Reports for every prefix of an object-store location, oldest first; those off the current line are
    marked abandoned."""
    prefixes = remote.prefixes()
    line = {p.name for p in remote.line(prefixes)}
    reports = []
    with ThreadPoolExecutor(threads or default_threads()) as pool:
        for prefix in prefixes:
            report = verify_remote(remote, prefix.name, quick, progress, prefixes, pool)
            report.abandoned = report.manifest is not None and prefix.name not in line
            reports.append(report)
    return reports
