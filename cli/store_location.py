"""Where a command's snapshots live: a local directory or an object-store URL, told apart in one place.

Every command that takes a checkpoint location (``launch --ckpt-dir``,
``verify``, ``export``, ``estimate-rto``; through ``run.json`` also ``resume``
and ``status``) goes through here: a URL either works or is refused with exit
2 and the package to install — never treated as a local directory named
``s3:``. A run's store is named in its ``run.json`` (the URL and the storage
options that are not credentials); credentials come from the environment,
``~/.aws`` or ``--storage-option`` and are never written there. A shared
helper: imports only the error type and the runtime's torch-free contracts.
"""

from __future__ import annotations

import atexit
import json
import shutil
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable

from ckptrun.cli.errors import EXIT_NO, EXIT_REFUSED, CkptrunError
from ckptrun.runtime.storage.ckpt_url import StoreUrl, UrlError, merge_options, parse, parse_storage_options, split_secrets
from ckptrun.runtime.storage.remote_store import FsspecStore

STAGING = "staging"  # RUN_DIR/staging: a store run's local copies without --local-cache, emptied after each upload
STORAGE_OPTION = "--storage-option"
REDACTED = "<redacted>"


def location(text: str | Path) -> Path | StoreUrl:
    """A local path or a usable store URL; exit 2 with the fix otherwise."""
    try:
        return parse(text)
    except UrlError as exc:
        raise CkptrunError(str(exc), exc.hint, EXIT_REFUSED) from None


def open_store(url: str, options: dict[str, Any] | None = None, run_id: str | None = None) -> FsspecStore:
    parsed = location(url)
    if not isinstance(parsed, StoreUrl):
        raise CkptrunError(f"{url} is not an object-store URL", "pass s3://BUCKET/PREFIX or another fsspec URL")
    return FsspecStore(parsed, options, run_id)  # run_id: list, chain and restore only that run's snapshots


def probe_writable(remote: FsspecStore) -> None:
    """A real write and delete under the run's prefix (a listing succeeds on a missing bucket or a read-only
    key): exit 2 before anything runs, rather than a whole run that trains and keeps nothing."""
    from ckptrun.runtime.storage.transfer import describe

    probe = f"{remote.url.path.rstrip('/')}/.ckptrun-write-probe-{uuid.uuid4().hex[:8]}"
    try:
        remote.fs.pipe_file(probe, b"ckptrun")
        remote.fs.rm_file(probe)
    except Exception as exc:  # noqa: BLE001 - no bucket, denied, read-only: one line, not a traceback
        raise CkptrunError(f"cannot write to {remote.where}: {describe(exc)}",
                           "create the bucket or prefix, or fix the credentials' write permission "
                           "(environment, ~/.aws, --storage-option)", EXIT_REFUSED) from None


def cannot_list(remote: FsspecStore, exc: BaseException) -> CkptrunError:
    """The one line for a store that could not be listed. A storage option the filesystem does not take
    (s3fs passes unknown ones down to its session as keywords) is named, with the fix, rather than the
    TypeError it raises."""
    import re

    from ckptrun.runtime.storage.transfer import describe

    chain, cause = [], exc  # the TypeError may come wrapped (StoreUnavailable from a restore's listing)
    while cause is not None and cause not in chain:
        chain.append(cause)
        cause = cause.__cause__
    for link in chain:
        unknown = re.search(r"unexpected keyword argument '([^']+)'", str(link)) if isinstance(link, TypeError) else None
        if unknown:
            return CkptrunError(f"{remote.where}: --storage-option {unknown.group(1)} is not an option of the "
                                f"{remote.url.protocol} filesystem", "drop it, or nest it where the filesystem takes it "
                                "(e.g. config_kwargs.retries.max_attempts=2 for s3)")
    said = str(exc) if str(exc).startswith(f"cannot list {remote.where}") else f"cannot list {remote.where}: {describe(exc)}"
    return CkptrunError(said, "check the URL, the endpoint and the credentials (environment, ~/.aws, --storage-option)")


def probe_local_dir(path: Path, what: str) -> None:
    """``path`` is a directory this process can write in, or can be made one: a real write and delete in it
    (or in its nearest existing parent, so a refusal creates nothing). Exit 2 before anything starts (a
    regular file, a path under /proc, no permission), never an internal error."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    probe = existing / f".ckptrun-write-probe-{uuid.uuid4().hex[:8]}"
    try:
        if not existing.is_dir():
            raise NotADirectoryError(20, f"{existing} is not a directory")
        probe.write_bytes(b"ckptrun")
        probe.unlink()
    except OSError as exc:
        raise CkptrunError(f"{what} {path} cannot be used: {exc.strerror or exc}",
                           f"pass a writable directory as {what}", EXIT_REFUSED) from None


def split_spec(data: dict[str, Any]) -> dict[str, Any]:
    """A launch spec's raw values: ``ckpt_dir`` that is a URL becomes ``store_url``; ``--storage-option``
    items become options, those that look like credentials kept apart (never written to run.json)."""
    data = dict(data)
    given = data.get("ckpt_dir")
    if given is not None:
        parsed = location(str(given))
        if isinstance(parsed, StoreUrl):
            data["store_url"], data["ckpt_dir"] = parsed.url, None
    items = data.get("store_options")
    if isinstance(items, (list, tuple, str)):
        try:
            items = parse_storage_options(items)
        except UrlError as exc:
            raise CkptrunError(str(exc), exc.hint, EXIT_REFUSED) from None
    if isinstance(items, dict):  # parsed here, or a dict (resume's merged options): credentials at any depth go apart
        data["store_options"], found = split_secrets(items)
        data["store_secrets"] = merge_options(data.get("store_secrets") or {}, found)
    return data


def resume_options(spec: Any, items: list[str]) -> dict[str, Any]:
    """``resume --storage-option``: the run's stored options with ``items`` laid over them (credentials are
    never in run.json, so a run that took them from ``--storage-option`` needs them again here)."""
    if getattr(spec, "store_url", None) is None:
        raise CkptrunError("--storage-option applies to a run whose --ckpt-dir is an object-store URL; this run's "
                           "snapshots are local", "drop --storage-option", EXIT_REFUSED)
    try:
        given = parse_storage_options(items)
    except UrlError as exc:
        raise CkptrunError(str(exc), exc.hint, EXIT_REFUSED) from None
    return merge_options(spec.store_options, given)


def redact_argv(argv: list[str]) -> list[str]:
    """``argv`` as it may be written (run.json, events, the lock file): every ``--storage-option`` value
    becomes ``KEY=<redacted>`` (either form, ``--storage-option K=V`` or ``--storage-option=K=V``)."""
    out: list[str] = []
    redact_next = False
    for word in argv:
        if redact_next:
            out.append(_redacted(word))
            redact_next = False
        elif word == STORAGE_OPTION:
            out.append(word)
            redact_next = True
        elif word.startswith(STORAGE_OPTION + "="):
            out.append(f"{STORAGE_OPTION}={_redacted(word[len(STORAGE_OPTION) + 1:])}")
        else:
            out.append(word)
        if word == "--":  # what follows is the script's own arguments
            out.extend(argv[len(out):])
            break
    return out


def _redacted(item: str) -> str:
    key, sep, _ = item.partition("=")
    return f"{key}={REDACTED}" if sep else REDACTED


def worker_fields(store_url: str | None, cache_dir: Path | None, options: dict[str, Any]) -> dict[str, Any]:
    """The C1 fields of a store run: the URL, whether the local dir is a cache, the fsspec options (JSON)."""
    if store_url is None:
        return {}
    return {"ckpt_url": store_url, "local_cache": cache_dir is not None,
            "storage_options": json.dumps(options) if options else None}


def local_dir(store_url: str | None, cache_dir: Path | None, ckpt_dir: Path | None, run_dir: Path) -> Path:
    """Where a run's snapshots are written locally: --ckpt-dir; for a store, --local-cache or RUN_DIR/staging."""
    if store_url is not None:
        return cache_dir if cache_dir is not None else run_dir / STAGING
    return ckpt_dir if ckpt_dir is not None else run_dir / "checkpoints"


def store_of(spec: Any, run_id: str | None = None, given: dict[str, Any] | None = None) -> FsspecStore | None:
    """The object store a launch spec names (None for a local run), bound to run ``run_id`` when given;
    ``given`` (a command's ``--storage-option``) over the spec's options."""
    if spec is None or getattr(spec, "store_url", None) is None:
        return None
    stored = merge_options(spec.store_options, spec.store_secrets)
    return open_store(spec.store_url, merge_options(stored, given or {}), run_id)


def store_of_run(run_dir: Path, given: dict[str, Any] | None = None) -> FsspecStore | None:
    """The object store named by ``RUN_DIR/run.json``, bound to that run (None when local or unreadable):
    commands that read a run; ``given`` (``--storage-option``) over the stored options."""
    try:
        record = json.loads((run_dir / "run.json").read_text())
        spec = record["spec"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    url = spec.get("store_url") if isinstance(spec, dict) else None
    options = merge_options(spec.get("store_options") or {}, given or {})
    return open_store(url, options, record.get("run_id")) if url else None


def given_options(items: list[str] | None) -> dict[str, Any]:
    """A command's ``--storage-option KEY=VALUE`` items as fsspec options (exit 2 on a malformed one)."""
    try:
        return parse_storage_options(items or [])
    except UrlError as exc:
        raise CkptrunError(str(exc), exc.hint, EXIT_REFUSED) from None


def store_at(where: Path | StoreUrl, items: list[str] | None = None) -> FsspecStore | None:
    """The store a command that takes PATH reads, as ``launch`` would open it: a URL with the given options,
    or a run directory whose run.json names a store (its own snapshots there); None for local snapshots."""
    given = given_options(items)
    if isinstance(where, StoreUrl):
        return FsspecStore(where, given)
    remote = store_of_run(where, given) if where.is_dir() else None
    if remote is None and given:
        raise CkptrunError(f"{STORAGE_OPTION} applies to an object store; {where} holds local snapshots",
                           f"drop {STORAGE_OPTION}, or pass the store's URL (s3://…)")
    return remote


def cache_of_run(run_dir: Path) -> Path | None:
    """Where a command that reads a store run downloads its snapshot: the run's ``--local-cache`` (a restore tier,
    as a restart would use it), else None (a temporary directory): ``RUN_DIR/staging`` holds a snapshot only
    while it uploads, and a run dir gets no ``checkpoints/`` of a command's making. On many nodes each node's
    cache holds only its own ranks' files: None too."""
    try:
        spec = json.loads((run_dir / "run.json").read_text())["spec"]
        cache, nodes = spec.get("cache_dir"), int(str(spec.get("nnodes") or "1").split(":")[-1])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return Path(cache) if cache and nodes == 1 else None


def fetch_newest(store: FsspecStore, cache: Path | None, log: Callable[[str], None] = lambda _: None) -> Any:
    """The restore a restart would do (:func:`ckptrun.runtime.checkpoint.tiering.choose`) into ``cache`` (None: a
    temporary directory); exit 1 when no snapshot of the line verifies, 2 when the store holds none or cannot be
    listed."""
    from ckptrun.runtime.checkpoint.tiering import choose

    target = cache if cache is not None else Path(tempfile.mkdtemp(prefix="ckptrun-fetch-"))
    if cache is None:
        atexit.register(shutil.rmtree, target, True)  # a copy for this command only
    try:
        choice = choose(store, target, log)
    except Exception as exc:  # noqa: BLE001 - unreachable, credentials: one line, not a traceback
        raise cannot_list(store, exc) from None
    if choice is None and not store.published():  # this run never committed one: as for a local dir with none
        raise CkptrunError(f"no snapshot in {store.where} yet",
                           "there is nothing to resume from: launch the run again (`ckptrun launch ...` with a new --name)")
    if choice is None:
        raise CkptrunError(f"no snapshot in {store.where} verifies", f"`ckptrun verify {store.where}` says what is wrong", EXIT_NO)
    return choice


def say(line: str) -> None:
    print(f"ckptrun: {line}", file=sys.stderr, flush=True)
