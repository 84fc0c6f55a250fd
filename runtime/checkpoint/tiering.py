"""Which copy a restart restores from: the verified local copy when it is the newest remote snapshot, else the store.

A tiered run (``--ckpt-dir s3://… --local-cache DIR``) publishes every save
locally first and uploads it in the background, so after a crash the node
usually holds the newest snapshot already. The remote manifests are the
truth: the newest committed prefix of the current line (:func:`remote_store.chain`)
is the candidate; the local copy is used when its manifest is the same
(:func:`store_backend.manifest_digest`) and every byte of it verifies. A restart
(``at_load``) checks the copy's manifest and sizes here and leaves the bytes to
the load, which hashes every chunk as it reads it: each byte hashed once. A
copy that then fails its digest at load is set aside and the same snapshot
downloaded again (the store's bytes may be good; :func:`refetch_after`).
Otherwise — no local copy (a lost node, a staging-only run), a local copy
that does not verify — the prefix is downloaded into the local directory,
every object hashed against its manifest as it streams; a mismatch refuses
that snapshot and the previous one is tried. A storage error (after retries)
is not a mismatch: the listing or the download raises
:class:`~ckptrun.runtime.storage.transfer.StoreUnavailable` instead of falling back to
an older snapshot or to none, which would restart training off the line.
A node's cache on many nodes holds only its own ranks' files of each snapshot
(:mod:`node_cache`): the files it lacks are downloaded into it first, hashed as
they stream, and the copy is then used as any local copy. Either way the workers
then load a local directory, as in a local run.
Importable without torch.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ckptrun.runtime.storage.remote_store import FsspecStore, Prefix
from ckptrun.runtime.storage.store_backend import LocalStore, Published
from ckptrun.runtime.storage.transfer import MismatchError, Retry, StoreUnavailable, copy_snapshot, describe
from ckptrun.runtime.checkpoint.node_cache import absent, fill
from ckptrun.runtime.checkpoint.verify import verify_snapshot

LOCAL, REMOTE = "local-cache", "remote"


@dataclass(frozen=True)
class Choice:
    """The snapshot to load (a local directory), where it came from and why."""

    path: Path
    step: int
    source: str  # LOCAL or REMOTE
    reason: str
    remote: str  # URL of the remote prefix it matches
    digest: str  # manifest digest: names the snapshot whichever copy is loaded
    seconds: float  # choosing, verifying and (for REMOTE) downloading
    bytes: int
    downloaded: int = 0  # bytes read from the store: all of them (REMOTE), the files a node's cache lacked (LOCAL)

    def event_fields(self) -> dict[str, object]:
        return {"source": self.source, "reason": self.reason, "snapshot": str(self.path), "remote": self.remote,
                "step": self.step, "seconds": self.seconds, "bytes": self.bytes,
                "tier": "local-cache" if self.source == LOCAL else "durable", "durable_bytes_read": self.downloaded}


def size_problems(snapshot: Published, prefix: Prefix | None) -> list[str]:
    """Objects that are missing or whose size differs from the manifest: found from the listing alone."""
    objects = prefix.objects if prefix is not None else {}
    problems = []
    for entry in snapshot.manifest.files:
        size = objects.get(entry.path)
        if size is None:
            problems.append(f"{entry.path}: missing")
        elif size != entry.size:
            problems.append(f"{entry.path}: size {size} bytes, manifest says {entry.size}")
    return problems


def remote_candidates(remote: FsspecStore, skip: frozenset[str] | set[str] = frozenset()) -> tuple[list[Published], dict[str, Prefix]]:
    """The current line's committed snapshots, newest first (``skip``: manifest digests known not to load),
    and the listing they came from."""
    prefixes = remote.prefixes()
    line = remote.line(prefixes)
    return [p for p in reversed(line) if p.digest not in skip], {p.name: p for p in prefixes}


def listed_candidates(remote: FsspecStore, skip: frozenset[str] | set[str] = frozenset(), retry: Retry = Retry(),
                      log: Callable[[str], None] = lambda _: None) -> tuple[list[Published], dict[str, Prefix]]:
    """:func:`remote_candidates` with retries; :class:`StoreUnavailable` when the store cannot be listed."""
    try:
        return retry.run(lambda: remote_candidates(remote, skip), f"listing {remote.where}", log)
    except Exception as exc:  # noqa: BLE001 - storage libraries raise anything: unknown, not empty
        raise StoreUnavailable(f"cannot list {remote.where}: {describe(exc)}") from exc


def choose(remote: FsspecStore, cache: Path, log: Callable[[str], None] = lambda _: None,
           skip: frozenset[str] | set[str] = frozenset(), retry: Retry = Retry(), threads: int = 8,
           at_load: bool = False, digest: str | None = None) -> Choice | None:
    """The newest snapshot of the current line that verifies, as a local directory, saying why newer ones were
    skipped. None only when the line has no committed snapshot that verifies; :class:`StoreUnavailable` when
    the store fails (listing, or downloading the candidate). ``at_load``: the caller loads the choice, which
    hashes a chunked snapshot's bytes as it reads them, so a local copy is checked by manifest and sizes.
    ``digest``: that snapshot only (another node's leader chose it). A node's cache that holds some files
    of the snapshot (its own ranks', :mod:`node_cache`) is filled with the rest from the store."""
    local = LocalStore(cache)
    candidates, listing = listed_candidates(remote, skip, retry, log)
    for snapshot in (c for c in candidates if digest is None or c.digest == digest):
        started = time.monotonic()
        where = remote.location(snapshot.name)
        problems = size_problems(snapshot, listing.get(snapshot.name))
        if problems:
            log(f"skipping {where}: objects changed after its manifest ({'; '.join(problems[:3])})")
            continue
        filled = _fill_partial(remote, local, snapshot, retry, threads, log)
        copy, why = _local_copy(local, snapshot, log, at_load)
        if copy is not None:
            return Choice(copy, snapshot.step, LOCAL, why + (f"; {filled} bytes this node's cache lacked downloaded"
                                                               if filled else ""), where, snapshot.digest,
                          time.monotonic() - started, snapshot.manifest.total_bytes, filled)
        try:
            fetched = copy_snapshot(remote, snapshot, local, retry, threads, log)
        except MismatchError as exc:
            log(f"skipping {where}: {exc}")
            continue
        except Exception as exc:  # noqa: BLE001 - the store failed after retries: an older one would lose progress
            raise StoreUnavailable(f"downloading {where} failed: {describe(exc)}") from exc
        seconds = time.monotonic() - started
        log(f"using {where}: {why}; downloaded and verified {snapshot.manifest.total_bytes} bytes in {seconds:.2f}s")
        return Choice(Path(fetched.where), snapshot.step, REMOTE, why, where, snapshot.digest, seconds,
                      snapshot.manifest.total_bytes, snapshot.manifest.total_bytes)
    return None


def _fill_partial(remote: FsspecStore, local: LocalStore, snapshot: Published, retry: Retry, threads: int,
                  log: Callable[[str], None]) -> int:
    """A local copy that holds only some of the snapshot's files (a node's cache): download the others into
    it, hashed as they stream; returns the bytes downloaded (0: no such copy, or one that fails to fill)."""
    copy = local.find(snapshot.digest)
    missing = absent(Path(copy.where), snapshot.manifest) if copy is not None else []
    if copy is None or not missing or len(missing) == len(snapshot.manifest.files):
        return 0
    try:
        filled = fill(remote, snapshot, Path(copy.where), missing, retry, threads, log)
    except Exception as exc:  # noqa: BLE001 - a mismatch or a store error: the whole download decides next
        log(f"filling the local copy {copy.where} from {remote.location(snapshot.name)} failed: {describe(exc)}")
        return 0
    log(f"local copy {copy.where}: {len(snapshot.manifest.files) - len(missing)} file(s) held here, "
        f"{len(missing)} ({filled} bytes) downloaded and verified")
    return filled


def _local_copy(local: LocalStore, snapshot: Published, log: Callable[[str], None],
                at_load: bool) -> tuple[Path | None, str]:
    """The local copy of ``snapshot`` when it verifies (path, why); else (None, why the store is used)."""
    copy = local.find(snapshot.digest)
    if copy is None:
        return None, f"no local copy of step {snapshot.step} in {local.where}"
    report = verify_snapshot(Path(copy.where), at_load=at_load)
    if not report.ok:
        return None, f"the local copy {copy.where} does not verify ({'; '.join(report.problems[:2])})"
    if report.deferred:
        log(f"using local copy {copy.where}: manifest and sizes match {snapshot.name}, every byte verified as it loads")
        return Path(copy.where), f"the local copy matches the remote manifest {snapshot.name} (bytes verified at load)"
    log(f"using local copy {copy.where}: verified {report.bytes} bytes, matches {snapshot.name}")
    return Path(copy.where), f"the local copy verifies and matches the remote manifest {snapshot.name}"


def damaged_copy(choice_source: str, reason: str) -> bool:
    """A local copy whose bytes failed their digest at load (``reason`` names a ``DigestMismatch``): the copy is
    damaged, not necessarily the snapshot, so the same snapshot is fetched again from the store, once."""
    return choice_source == LOCAL and "DigestMismatch" in reason


def choose_for_worker(remote: FsspecStore, cache: Path, run_dir: Path, skip_names: set[str],
                      log: Callable[[str], None]) -> Choice | None:
    """Rank 0 under plain torchrun: the snapshot to load, recording where it came from (``restore_source``)."""
    from ckptrun.runtime import records
    from ckptrun.runtime.manifest import ManifestError, read_manifest
    from ckptrun.runtime.storage.store_backend import manifest_digest

    skip = set()
    for name in skip_names:
        try:
            skip.add(manifest_digest(read_manifest(cache / name)))
        except ManifestError:
            continue
    try:
        choice = choose(remote, cache, log, skip, at_load=True)
    except Exception as exc:  # noqa: BLE001 - the store failed: which snapshot is newest, or its bytes, is unknown
        print(f"error: cannot restore from {remote.where}: {describe(exc)}", file=sys.stderr, flush=True)
        print("hint: check the endpoint and credentials (environment, ~/.aws, --storage-option)", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    if choice is not None:
        records.log_event(run_dir, "restore_source", **choice.event_fields())
    return choice
