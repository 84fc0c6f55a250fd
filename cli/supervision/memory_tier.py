"""The memory tier, supervisor side: the ``/dev/shm`` directory it owns, and whether a restart restores from it.

With ``--memory-every-steps`` the supervisor creates ``/dev/shm/ckptrun-<run id>-<host>``
(mode 0700) before the first attempt, names it in C1 (``RunEnv.memory_dir``)
and deletes it when it leaves, whatever the exit path (the world's ``close``).
The ranks write ordinary snapshots there (:mod:`ckptrun.runtime.checkpoint.memory_tier`);
because the supervisor, not a rank, owns the directory, they survive a rank
crash. A supervisor killed with SIGKILL cannot clean up: the next ckptrun
supervisor on the host (any launch, with the tier or not) and ``ckptrun verify`` remove
directories whose owner is gone.

Restart choice: the newest memory snapshot of this run and of the current
lineage (the durable directory's ``lineage.json``) that is newer than the
newest verified durable snapshot and passes the pre-load check is used
(manifest and sizes for a chunked manifest, whose digests the ranks check as
they load it; every digest for an older one); else the durable one. A memory snapshot that fails the check is skipped and
deleted, never quarantined into the durable directory; so are the memory
snapshots newer than the one chosen (a future the restart will not replay).
The ``restore_source`` event says which tier and why.

Many nodes: each node's ranks write their own shards (a snapshot of the node's ranks,
with its own manifest and digests) into the node's directory (``--memory-dir``,
default ``/dev/shm/ckptrun-<run>-node<k>``). After a teardown every node tells the
leader which of its memory steps are usable (:meth:`MemoryDir.usable_steps`, in its
teardown acknowledgement); the leader restarts from the newest step every node holds,
when it is newer than the newest durable snapshot, and each node resumes from its own
copy of that step (:meth:`MemoryDir.use_step`). A node whose directory is gone (its
launcher was replaced) holds none: the restart is durable. Importable without torch.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import psutil

from ckptrun.cli.errors import EXIT_REFUSED, CkptrunError
from ckptrun.cli.supervision.observation import Snapshot
from ckptrun.cli.supervision.rundir import alive
from ckptrun.runtime.storage import store
from ckptrun.runtime.manifest import ManifestError, read_manifest
from ckptrun.runtime.checkpoint.verify import verify_snapshot

SHM_ROOT = Path("/dev/shm")
DIR_PREFIX = "ckptrun-"
OWNER = "owner.json"


def directory_name(run_id: str, host: str | None = None) -> str:
    """``ckptrun-<run id>-<host>``: one per run and node, in characters any filesystem takes."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", f"{DIR_PREFIX}{run_id}-{host or socket.gethostname()}")


def refuse_unsupported(spec: Any, root: Path = SHM_ROOT) -> None:
    """Before anything runs: the tier needs a writable directory of its own (exit 2 otherwise)."""
    if not spec.memory_every_steps:
        return
    given = getattr(spec, "node_memory_dir", None)
    if given is not None:
        given = Path(given)
        if given.exists() and (not given.is_dir() or any(given.iterdir()) and not (given / OWNER).exists()):
            raise CkptrunError(f"--memory-dir {given}: exists and holds files that are not a ckptrun memory tier's "
                               "(the launch deletes the directory when it ends)", "pass a new or empty directory",
                               EXIT_REFUSED)
        parent = given if given.is_dir() else given.parent
        if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
            raise CkptrunError(f"--memory-dir {given}: {parent} is not a writable directory",
                               "pass a directory on a tmpfs this user can write (e.g. under /dev/shm)", EXIT_REFUSED)
        return
    if not root.is_dir() or not os.access(root, os.W_OK | os.X_OK):
        raise CkptrunError(f"--memory-every-steps needs node-local shared memory at {root}, and this machine has "
                           "none there (or it is not writable)",
                           f"drop --memory-every-steps (durable snapshots only), mount a tmpfs at {root}, "
                           "or name one with --memory-dir", EXIT_REFUSED)


def sweep_stale(root: Path = SHM_ROOT) -> list[Path]:
    """Remove memory directories whose supervisor is gone (it was killed before it could clean up)."""
    removed = []
    for path in root.glob(f"{DIR_PREFIX}*"):
        try:
            owner = json.loads((path / OWNER).read_text())
            gone = not alive(int(owner["pid"]), float(owner["start_time"]))
        except (OSError, ValueError, KeyError, TypeError):
            gone = path.is_dir() and time.time() - path.stat().st_mtime > 60  # no owner file after a minute
        if gone:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


@dataclass
class Choice:
    """The snapshot a restart uses, which tier it is in, why, and the memory snapshots passed over."""

    snapshot: Snapshot | None
    tier: str  # "memory", "disk" or "none"
    reason: str
    skipped: list[dict[str, Any]] = field(default_factory=list)

    def to_event(self) -> dict[str, Any]:
        return {"tier": self.tier, "snapshot": str(self.snapshot.path) if self.snapshot else None,
                "step": self.snapshot.step if self.snapshot else None, "reason": self.reason, "skipped": self.skipped}


def choose(durable: Snapshot | None, memory_dir: Path, ckpt_dir: Path, run_id: str) -> Choice:
    """Memory when its newest usable snapshot is newer than ``durable`` (already verified), else ``durable``."""
    floor = durable.step if durable is not None else -1
    try:
        lineage = store.read_lineage(ckpt_dir)
    except store.LineageError as exc:
        return Choice(durable, _tier(durable), f"the lineage is unreadable, memory not trusted: {exc}")
    skipped: list[dict[str, Any]] = []
    entries = [e for e in store.list_entries(memory_dir, include_abandoned=False) if e.kind == "published"]
    for entry in sorted(entries, key=lambda e: e.step, reverse=True):
        if entry.step <= floor:
            break
        problem = _unusable(entry.path, lineage, run_id)
        if problem is None:
            started = time.monotonic()
            report = verify_snapshot(entry.path, at_load=True)  # chunked: sizes here, digests as loaded
            if report.ok:
                newer = f"the newest durable one (step {floor})" if durable else "any durable one (none verified)"
                return Choice(Snapshot(entry.path, entry.step, time.monotonic() - started), "memory",
                              f"memory step {entry.step} is newer than {newer}", skipped)
            problem = f"does not verify ({report.status}): {'; '.join(report.problems[:2])}"
        skipped.append({"snapshot": str(entry.path), "step": entry.step, "reason": problem})
    if skipped:
        why = f"no usable memory snapshot newer than step {floor} ({len(skipped)} skipped)"
    else:
        why = f"no memory snapshot newer than step {floor}" if durable else "no snapshot in memory or on disk"
    return Choice(durable, _tier(durable), why, skipped)


def _tier(durable: Snapshot | None) -> str:
    return "disk" if durable is not None else "none"


def _unusable(path: Path, lineage: store.Lineage | None, run_id: str) -> str | None:
    """Why a memory snapshot may not be restored whatever its bytes say (another run, another line), or None."""
    try:
        manifest = read_manifest(path)
    except ManifestError as exc:
        return f"no readable manifest: {exc}"
    if manifest.run_id != run_id:
        return f"written by run {manifest.run_id}, not {run_id}"
    if lineage is not None and not lineage.contains(manifest):
        return f"of lineage {manifest.lineage}, not the current one ({lineage.current}): never across a fork"
    return None


class MemoryDir:
    """The run's memory directory on this node (``path`` None: the tier is off)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path

    @classmethod
    def open(cls, spec: Any, run_id: str, root: Path = SHM_ROOT) -> "MemoryDir":
        """Create the directory for this supervisor (an older one of this run, left by a killed supervisor, goes).
        Every launch sweeps the host's stale directories first, with the tier or without it."""
        sweep_stale(root)
        if not spec.memory_every_steps:
            return cls(None)
        refuse_unsupported(spec, root)
        many = spec.nnodes.split(":")[-1] != "1"  # nodes of one job may share a host (tests): one directory each
        path = Path(spec.node_memory_dir) if spec.node_memory_dir else \
            root / directory_name(run_id, f"node{spec.node_rank}" if many else None)
        shutil.rmtree(path, ignore_errors=True)  # ours (refuse_unsupported); the run lock says no other supervisor
        path.mkdir(mode=0o700, parents=True)
        me = psutil.Process()
        (path / OWNER).write_text(json.dumps({"pid": me.pid, "start_time": me.create_time(), "run_id": run_id}))
        return cls(path)

    def choose(self, durable: Snapshot | None, ckpt_dir: Path, run_id: str,
               event: Callable[..., None], say: Callable[[str], None]) -> Snapshot | None:
        """The snapshot a restart uses (see :func:`choose`), with a ``restore_source`` event; memory snapshots
        skipped or newer than the choice are deleted."""
        if self.path is None:
            return durable
        choice = choose(durable, self.path, ckpt_dir, run_id)
        self._drop_newer(choice.snapshot.step if choice.snapshot else -1)
        event("restore_source", **choice.to_event())
        if choice.tier == "memory" or choice.skipped:
            say(f"restore from {choice.tier}: {choice.reason}")
        return choice.snapshot

    def holds(self, snapshot: Path | None) -> bool:
        return self.path is not None and snapshot is not None and Path(snapshot).parent.resolve() == self.path.resolve()

    def usable_steps(self, ckpt_dir: Path, run_id: str) -> list[int]:
        """Many nodes: the steps of this node's memory snapshots a restart could use (this run, the current
        lineage, manifest and sizes right), newest first; what the node tells the leader after a teardown."""
        return [step for step, _ in self._usable(self.path, ckpt_dir, run_id)] if self.path is not None else []

    def replica_steps(self, ckpt_dir: Path, run_id: str) -> dict[int, dict[int, int]]:
        """Many nodes: the replicas of other nodes' memory snapshots this node holds, verified on receipt and
        usable as :meth:`usable_steps` says ({node: {step: bytes}}); also told the leader after a teardown."""
        if self.path is None:
            return {}
        found = {}
        for directory in sorted((self.path / store.REPLICAS_DIR).glob("node*")):
            if directory.name[4:].isdigit():
                found[int(directory.name[4:])] = dict(self._usable(directory, ckpt_dir, run_id))
        return found

    @staticmethod
    def _usable(directory: Path, ckpt_dir: Path, run_id: str) -> list[tuple[int, int]]:
        """(step, bytes) of the snapshots in ``directory`` a restart could use, newest first."""
        try:
            lineage = store.read_lineage(ckpt_dir)
        except store.LineageError:
            return []
        entries = [e for e in store.list_entries(directory, include_abandoned=False) if e.kind == "published"]
        return [(e.step, read_manifest(e.path).total_bytes) for e in sorted(entries, key=lambda e: e.step, reverse=True)
                if _unusable(e.path, lineage, run_id) is None and verify_snapshot(e.path, at_load=True).ok]

    def use_step(self, step: int | None, why: str, event: Callable[..., None], say: Callable[[str], None],
                 durable: Snapshot | None = None, peer: dict[str, int] | None = None,
                 durable_told: bool = False) -> Snapshot | None:
        """Many nodes: the step the leader chose for every node (None: durable), from this node's directory;
        ``peer`` ({"from": node, "bytes": n}): this node has no copy of that step, and its ranks fetch their
        shards from that node's replica before they load (tier ``peer-memory``). The memory snapshots and
        replicas newer than the choice go (a future the restart will not replay). ``durable_told``: this
        node's durable restore has its own ``restore_source`` (an object store's choice): none here then."""
        if self.path is None:
            return durable
        self._drop_newer(step if step is not None else durable.step if durable is not None else -1)
        chosen = Snapshot(self.path / store.snapshot_name(step), step) if step is not None else durable
        tier = ("peer-memory" if peer else "memory") if step is not None else _tier(durable)
        fetched = {"peer": peer["from"], "bytes_moved": peer.get("bytes")} if peer else {}
        if step is None and durable_told:
            return chosen
        event("restore_source", tier=tier, snapshot=str(chosen.path) if chosen else None,
              step=chosen.step if chosen else None, reason=why, skipped=[],
              durable_bytes_read=0 if step is not None else None, **fetched)
        if step is not None:
            say(f"restore from {tier}: {why}")
        return chosen

    def _drop_newer(self, keep_up_to: int) -> None:
        """Delete the memory snapshots (and replicas) newer than the restart's choice: a future the restart will
        not replay."""
        for directory in [self.path, *sorted((self.path / store.REPLICAS_DIR).glob("node*"))]:  # type: ignore[operator]
            for entry in store.list_entries(directory, include_abandoned=True):  # type: ignore[arg-type]
                if entry.step > keep_up_to and entry.kind in ("published", "quarantined"):
                    shutil.rmtree(entry.path, ignore_errors=True)

    def remove(self) -> None:
        """Delete the directory and every memory snapshot in it (the run ends, or the supervisor leaves)."""
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
