"""Which snapshot the supervisor restarts from, for a local checkpoint dir or an object store.

Local: the newest snapshot of the lineage that verifies (:func:`runtime.checkpoint.verify.newest_verified`): for a
chunked (schema 3) manifest only manifest and sizes are checked here, because the workers verify every
byte they load as they read it; older snapshots are hashed whole.
Object store: the newest committed manifest of the line, loaded from the
verified local copy when it is the same snapshot, else downloaded into the
local directory with every object hashed (:mod:`ckptrun.runtime.checkpoint.tiering`); a
``restore_source`` event says which and why. Either way the workers load a
local directory. A snapshot the workers could not load is skipped on the
store too (by its manifest digest) — except a local copy whose bytes failed
their digest at load: the copy is damaged, so the same snapshot is downloaded
again, once (:func:`tiering.damaged_copy`) — so is one the ranks quarantined as
poisoned (its values blamed right after the restore), and a fork — a resumed attempt that
diverged — writes the store's fork marker instead of moving directories.

A store that fails after the retries is not an empty store: :meth:`newest`
raises :class:`SnapshotUnavailable` and the supervisor ends the run
resumably (exit 3) instead of restarting from step 0 off the line. The step
alone (:meth:`newest_step`, for a stop's report or the memory tier's floor)
comes from the listing and the manifests, without downloading anything.
Importable without torch.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from ckptrun.cli.supervision.observation import Snapshot
from ckptrun.runtime.storage import store
from ckptrun.runtime.manifest import ManifestError, read_manifest
from ckptrun.runtime.storage.remote_store import FsspecStore
from ckptrun.runtime.storage.store_backend import manifest_digest
from ckptrun.runtime.checkpoint.tiering import Choice, choose, damaged_copy, listed_candidates
from ckptrun.runtime.storage.transfer import Retry, describe
from ckptrun.runtime.checkpoint.verify import newest_verified


class SnapshotUnavailable(RuntimeError):
    """The snapshot store failed after retries: the newest snapshot is unknown, not absent."""


class SnapshotSource:
    """The supervisor's choice of snapshot, and what it does to one that failed."""

    def __init__(self, ckpt_dir: Path, remote: FsspecStore | None, say: Callable[[str], None],
                 event: Callable[..., None], retry: Retry = Retry(), cache: Path | None = None) -> None:
        self.ckpt_dir, self.remote, self.say, self.event, self.retry = ckpt_dir, remote, say, event, retry
        self.cache = cache or ckpt_dir  # where a store's snapshot is restored from or into: on many nodes, the node's
        self.refused: set[str] = set()  # manifest digests of snapshots that did not load
        self.refetched: set[str] = set()  # digests whose damaged local copy was set aside for a fresh download
        self.chosen: dict[str, Choice] = {}  # the store choices handed to attempts, by local path

    def newest(self) -> Snapshot | None:
        started = time.monotonic()
        if self.remote is None:
            report = newest_verified(self.ckpt_dir, log=self.say, at_load=True)
            return Snapshot(report.path, report.step, time.monotonic() - started) if report else None
        try:
            choice = choose(self.remote, self.cache, self.say, self.refused, self.retry, at_load=True)
        except Exception as exc:  # noqa: BLE001 - listing or downloading failed after retries: unknown, not none
            raise self._unavailable(exc) from exc
        if choice is None:
            return None
        self.event("restore_source", **choice.event_fields())
        self.chosen[str(choice.path)] = choice
        return Snapshot(choice.path, choice.step, time.monotonic() - started)

    def own_copy(self, digest: str, step: int) -> Snapshot | None:
        """The store snapshot another node's leader chose (by manifest digest), as this node's own copy: its
        cache's files, the rest downloaded and hashed (``restore_source``); None when it cannot be had."""
        started = time.monotonic()
        try:
            choice = choose(self.remote, self.cache, self.say, retry=self.retry, at_load=True, digest=digest)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 - the ranks then fail to load it, and the leader decides
            self.say(f"cannot fetch step {step} from the store: {describe(exc)}")
            return None
        if choice is None:
            return None
        self.event("restore_source", **choice.event_fields())
        return Snapshot(choice.path, choice.step, time.monotonic() - started)

    def newest_step(self) -> int | None:
        """The step :meth:`newest` would restore, from the store's listing and manifests (nothing downloaded);
        locally, the newest verified snapshot's."""
        if self.remote is None:
            report = newest_verified(self.ckpt_dir, log=self.say, at_load=True)
            return report.step if report else None
        try:
            candidates, _ = listed_candidates(self.remote, self.refused, self.retry, self.say)
        except Exception as exc:  # noqa: BLE001 - see newest()
            raise self._unavailable(exc) from exc
        return candidates[0].step if candidates else None

    def _unavailable(self, exc: BaseException) -> SnapshotUnavailable:
        self.say(f"the store failed: {describe(exc)}")
        self.event("store_unavailable", store=self.remote.where, error=describe(exc))  # type: ignore[union-attr]
        return SnapshotUnavailable(f"the object store {self.remote.where} failed after retries "  # type: ignore[union-attr]
                                   f"({describe(exc)}): the newest snapshot is unknown")

    def quarantine(self, snapshot: Path, status: str, reason: str) -> Path:
        digest = _digest(snapshot)
        choice = self.chosen.get(str(snapshot))
        if digest is not None and choice is not None and damaged_copy(choice.source, reason) and digest not in self.refetched:
            self.refetched.add(digest)
            self.say(f"the local copy of step {choice.step} is damaged; the restart fetches it again from {choice.remote}")
        elif digest is not None:
            self.refused.add(digest)
        return store.quarantine(snapshot, status, reason)

    def refuse_poisoned(self, quarantined: list[dict[str, Any]]) -> None:
        """Snapshots the ranks quarantined as poisoned (``snapshot_quarantined``, cause ``poisoned``) are skipped
        on the store too. The ranks moved their local copy (the cache, or the staging a download went to), but
        that copy matched the store's digests: the store's bytes are the same poison, and a fresh download of
        it would be the second poisoned restore in a row instead of a restart from the one before it."""
        for record in quarantined:
            if record.get("cause") == "poisoned" and record.get("moved_to"):
                digest = _digest(Path(str(record["moved_to"])))
                if digest is not None:
                    self.refused.add(digest)

    def abandon_after(self, snapshot: Path | None) -> list[Path]:
        moved = store.abandon_after(self.ckpt_dir, snapshot)
        if self.remote is not None:
            self._fork_remote(snapshot)
        return moved

    def _fork_remote(self, snapshot: Path | None) -> None:
        """The store's line ends at the committed copy of ``snapshot`` (None: at nothing) until a newer save."""
        digest = _digest(snapshot) if snapshot is not None else None
        point = next((p.name for p in self.remote.published() if p.digest == digest), None) if digest else None  # type: ignore[union-attr]
        self.remote.fork(point)  # type: ignore[union-attr]
        self.event("store_forked", store=self.remote.where, fork_point=point)  # type: ignore[union-attr]


def _digest(snapshot: Path) -> str | None:
    try:
        return manifest_digest(read_manifest(snapshot))
    except ManifestError:
        return None
