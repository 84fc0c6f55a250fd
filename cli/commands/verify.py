"""``ckptrun verify PATH``: check every snapshot's bytes against its manifest.

PATH is a checkpoint directory (``step-*`` snapshots, ``lineage.json``), a run
directory (its ``checkpoints/`` is used), or one snapshot directory. The verdict
per snapshot comes from :mod:`ckptrun.runtime.checkpoint.verify`; this module only picks
what to check, shows progress on stderr and prints the report on stdout (a table,
or one JSON document with ``--json``).

Exit 0 when every published snapshot (abandoned ones included) verifies; saves in
progress and snapshots deleted by retention during the scan do not fail it.
Exit 1 when one is corrupt, incomplete or unloadable (quarantined because it
verified but did not load), 2 when PATH is not something to verify.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

import typer

from ckptrun.cli.errors import EXIT_NO, EXIT_OK, CkptrunError, command
from ckptrun.cli.humanize import human_age, human_bytes
from ckptrun.cli.commands.store_flag import storage_option_flag
from ckptrun.cli.store_location import cannot_list, location, store_at
from ckptrun.cli.supervision.memory_tier import sweep_stale
from ckptrun.runtime.storage.remote_store import FsspecStore
from ckptrun.runtime.manifest import MANIFEST_NAME, ManifestError, read_manifest
from ckptrun.runtime.storage.store import (
    ABANDONED_DIR,
    LINEAGE_NAME,
    QUARANTINE_DIR,
    SNAPSHOT_RE,
    TEMP_RE,
    Entry,
    Lineage,
    LineageError,
    list_entries,
    quarantine_reason,
    read_lineage,
)
from ckptrun.runtime.checkpoint import framework_files
from ckptrun.runtime.checkpoint.verify import (
    CORRUPT,
    IN_PROGRESS,
    INCOMPLETE,
    OK,
    VANISHED,
    SnapshotReport,
    bytes_to_verify,
    default_threads,
    report_entry,
    verify_remote_dir,
)

UNLOADABLE = "unloadable"
FAILING = (CORRUPT, INCOMPLETE, UNLOADABLE)
PATH_HINT = "pass a checkpoint directory (RUN_DIR/checkpoints), a run directory, one step-NNNNNNNNN snapshot directory or an object-store URL"


@command
def verify(
    path: str = typer.Argument(..., metavar="PATH", help="Checkpoint directory, run directory, one snapshot directory, or an object-store URL (s3://…)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document on stdout instead of a table."),
    quick: bool = typer.Option(False, "--quick", help="Check that files exist with the right sizes; skip digests."),
    threads: int | None = typer.Option(None, "--threads", min=1, metavar="N", help="Files hashed in parallel (default: CPUs, 2..8)."),
    storage_option: Optional[list[str]] = storage_option_flag(),
) -> int:
    """Check every snapshot's bytes against its manifest (exit 1 if any is corrupt or incomplete)."""
    sweep_stale()  # the /dev/shm memory directories of supervisors that were killed: reclaimed here too
    where = location(path)
    remote = store_at(where, storage_option)
    if remote is not None:
        if isinstance(where, Path):
            sys.stderr.write(f"verifying {remote.where} (run {where}'s snapshots live in the store)\n")
        return _verify_store(remote, as_json, quick, threads)
    path = where
    if framework_files.find(path) and not _is_ckpt_dir(path):
        return _verify_framework(path, as_json, quick)
    ckpt_dir, entries = _target(path)
    lineage, lineage_problems = _lineage(ckpt_dir)
    total = sum(_listed_bytes(e) for e in entries) if ckpt_dir is None else bytes_to_verify(ckpt_dir)
    try:
        with _progress(total, enabled=not quick and sys.stderr.isatty()) as progress:
            reports = _verify_entries(entries, lineage, quick, progress, threads or default_threads())
    except OSError as exc:
        raise CkptrunError(f"cannot read {exc.filename}: {exc.strerror}", hint="check the file permissions and the mount") from exc
    ok = not lineage_problems and not any(r.status in FAILING for r in reports)
    if as_json:
        _print_json(path, ok, quick, reports, lineage_problems)
    else:
        _print_table(reports, quick, lineage_problems)
    return EXIT_OK if ok else EXIT_NO


def _verify_store(remote: FsspecStore, as_json: bool, quick: bool, threads: int | None) -> int:
    """Every ``step-<N>-<id>/`` prefix: each object streamed and hashed (sizes only with --quick)."""
    try:
        reports = verify_remote_dir(remote, quick, None, threads)
    except Exception as exc:  # noqa: BLE001 - unreachable, no credentials, no bucket: one line
        raise cannot_list(remote, exc) from None
    if not reports:
        raise CkptrunError(f"{remote.where} holds no snapshot (no step-<N>-<id>/ prefixes)",
                           "check the URL (the prefix launch --ckpt-dir was given)")
    ok = not any(r.status in FAILING for r in reports)
    if as_json:
        _print_json(remote.where, ok, quick, reports, [])
    else:
        _print_table(reports, quick, [])
    return EXIT_OK if ok else EXIT_NO


def _verify_framework(path: Path, as_json: bool, quick: bool) -> int:
    """A Lightning / HF Trainer checkpoint directory published by ``ckptrun.integrations``."""
    verdicts = framework_files.report(path, sizes_only=quick)
    ok = not any(v["status"] in ("corrupt", "incomplete") for v in verdicts)
    if as_json:
        print(json.dumps({"path": str(path), "ok": ok, "quick": quick, "framework_checkpoints": verdicts}, indent=1))
        return EXIT_OK if ok else EXIT_NO
    for v in verdicts:
        problem = "; ".join(map(str, v["problems"]))  # type: ignore[arg-type]
        print(f"{v['step'] if v['step'] is not None else '-':>8}  {Path(str(v['path'])).name}  {v['framework'] or '-'}  "
              f"{v['files']} file(s)  {human_bytes(int(v['bytes']))}  {v['status']}  {problem}".rstrip())  # type: ignore[arg-type]
    good = sum(v["status"] == "ok" for v in verdicts)
    print(f"{good} of {len(verdicts)} framework checkpoint(s) verified{' (sizes only)' if quick else ''}")
    return EXIT_OK if ok else EXIT_NO


# --- what to verify ----------------------------------------------------------


def _target(path: Path) -> tuple[Path | None, list[Entry]]:
    """The checkpoint dir (None for a single snapshot) and the entries to check."""
    path = path.absolute()
    if path.name == MANIFEST_NAME and path.is_file():
        path = path.parent
    if not path.exists():
        raise CkptrunError(f"{path}: no such directory", hint=PATH_HINT)
    if not path.is_dir():
        raise CkptrunError(f"{path} is not a directory", hint=PATH_HINT)
    if (path / MANIFEST_NAME).exists() or (_looks_like_snapshot(path) and not _is_ckpt_dir(path)):
        return None, [_single_entry(path)]
    if _is_ckpt_dir(path):
        return path, list_entries(path)
    if _is_ckpt_dir(path / "checkpoints"):
        sys.stderr.write(f"verifying {path / 'checkpoints'}\n")
        return path / "checkpoints", list_entries(path / "checkpoints")
    raise CkptrunError(
        f"{path} is not a checkpoint directory: no step-NNNNNNNNN snapshots, no {LINEAGE_NAME}, no {MANIFEST_NAME}",
        hint=PATH_HINT,
    )


def _looks_like_snapshot(path: Path) -> bool:
    return bool(SNAPSHOT_RE.match(path.name) or TEMP_RE.match(path.name))


def _is_ckpt_dir(path: Path) -> bool:
    return path.is_dir() and ((path / LINEAGE_NAME).is_file() or (path / ABANDONED_DIR).is_dir()
                              or (path / QUARANTINE_DIR).is_dir() or bool(list_entries(path)))


def _single_entry(path: Path) -> Entry:
    step = _step_of(path.name)
    if TEMP_RE.match(path.name):
        return Entry(path, step, "temp")
    holder = path.parent.parent.name
    kind = {ABANDONED_DIR: "abandoned", QUARANTINE_DIR: "quarantined"}.get(holder, "published")
    return Entry(path, step, kind)


def _step_of(name: str) -> int:
    match = SNAPSHOT_RE.match(name) or TEMP_RE.match(name)
    return int(match.group(1)) if match else -1


def _lineage(ckpt_dir: Path | None) -> tuple[Lineage | None, list[str]]:
    """The lineage that decides 'abandoned', and a problem when lineage.json is unreadable."""
    if ckpt_dir is None:
        return None, []
    try:
        return read_lineage(ckpt_dir), []
    except LineageError as exc:
        return None, [f"{exc}; cannot tell the current line from abandoned ones"]


def _listed_bytes(entry: Entry) -> int:
    if entry.kind == "temp":
        return 0
    try:
        return read_manifest(entry.path).total_bytes
    except ManifestError:
        return 0


# --- verifying ---------------------------------------------------------------


def _verify_entries(
    entries: list[Entry], lineage: Lineage | None, quick: bool, progress: Callable[[int], None] | None, threads: int
) -> list[SnapshotReport]:
    with ThreadPoolExecutor(threads) as pool:
        return [_quarantined(entry, report_entry(entry, lineage, quick, progress, pool)) for entry in entries]


def _quarantined(entry: Entry, report: SnapshotReport) -> SnapshotReport:
    """A quarantined snapshot whose bytes verify takes the status it was set aside for (``unloadable``)."""
    if entry.kind != "quarantined":
        return report
    why = quarantine_reason(entry.path) or {}
    report.problems.insert(0, f"quarantined: {why.get('reason') or 'no reason recorded'}")
    if report.ok:
        report.status = why.get("status") or UNLOADABLE
    return report


@contextmanager
def _progress(total: int, enabled: bool) -> Iterator[Callable[[int], None] | None]:
    """A thread-safe callback that advances a tqdm bar of bytes hashed, on stderr."""
    if not enabled or total <= 0:
        yield None
        return
    from tqdm import tqdm

    lock = threading.Lock()
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="hashing", file=sys.stderr, leave=False) as bar:

        def advance(count: int) -> None:
            with lock:
                bar.update(count)

        yield advance


# --- output ------------------------------------------------------------------


def _print_json(path: Path | str, ok: bool, quick: bool, reports: list[SnapshotReport], problems: list[str]) -> None:
    document = {
        "ok": ok,
        "path": str(path.absolute()) if isinstance(path, Path) else path,
        "quick": quick,
        "problems": problems,
        "snapshots": [report.to_json() for report in reports],
    }
    sys.stdout.write(json.dumps(document, indent=2) + "\n")


COLUMNS = ("STEP", "LINEAGE", "FILES", "SIZE", "AGE", "STATUS", "NOTE", "PROBLEM")


def _print_table(reports: list[SnapshotReport], quick: bool, problems: list[str]) -> None:
    now = time.time()
    rows = [COLUMNS] + [_row(report, now) for report in reports]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS) - 1)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1] for row in rows]
    out = sys.stdout
    if reports:
        out.write("\n".join(line.rstrip() for line in lines) + "\n")
    for problem in problems:
        out.write(f"problem: {problem}\n")
    out.write(_summary(reports, quick) + "\n")


def _row(report: SnapshotReport, now: float) -> tuple[str, ...]:
    manifest = report.manifest
    problem = report.problems[0] if report.problems else ""
    if len(report.problems) > 1:
        problem += f" (+{len(report.problems) - 1} more, see --json)"
    return (
        str(report.step) if report.step >= 0 else report.path.name,
        manifest.lineage[:8] if manifest else "-",
        str(report.files) if manifest else "-",
        human_bytes(report.bytes) if manifest else "-",
        human_age(now - _created(report)),
        report.status,
        "abandoned" if report.abandoned else "",
        problem,
    )


def _created(report: SnapshotReport) -> float:
    if report.manifest is not None:
        return report.manifest.created
    try:
        return report.path.stat().st_mtime  # type: ignore[union-attr]
    except (OSError, AttributeError):  # an object-store prefix (a URL) has no stat
        return time.time()


def _summary(reports: list[SnapshotReport], quick: bool) -> str:
    if not reports:
        return "no snapshots found"
    published = [r for r in reports if r.status != IN_PROGRESS]
    statuses = (OK, CORRUPT, INCOMPLETE, UNLOADABLE, VANISHED)
    counts = [(sum(r.status == status for r in published), status) for status in statuses]
    text = f"{len(published)} snapshot{'' if len(published) == 1 else 's'}, {human_bytes(sum(r.bytes for r in published))}: "
    text += ", ".join(f"{count} {status}" for count, status in counts if count) or "none published"
    in_progress, abandoned = len(reports) - len(published), sum(r.abandoned for r in reports)
    text += f"; {in_progress} in progress" if in_progress else ""
    text += f"; {abandoned} abandoned" if abandoned else ""
    newest = [r.step for r in published if r.status == OK and not r.abandoned]
    text += f"; newest verified: step {max(newest)}" if newest else "; no verified snapshot on the current line"
    return text + (" (sizes only, --quick)" if quick else "")
