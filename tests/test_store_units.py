"""Object-store logic without a server or torch: fsspec's memory:// store, snapshots built by snapshot_factory.

The store failures are injected at the store's edge (a listing or a read that raises, as an outage does);
everything above it — choosing, the supervisor's verdict, retention, lineage — is the real code.
"""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import pytest
from snapshot_factory import make_chunked_snapshot, make_snapshot
from supervisor_helpers import T0, ScriptedWorld, supervisor, training

from ckptrun.cli.errors import CkptrunError
from ckptrun.cli.store_location import redact_argv, resume_options
from ckptrun.cli.supervision.memory_tier import MemoryDir
from ckptrun.cli.supervision.observation import Snapshot
from ckptrun.cli.supervision.rundir import RunLock, RunPaths
from ckptrun.cli.supervision.snapshot_source import SnapshotSource, SnapshotUnavailable
from ckptrun.cli.supervision.spec import RunRecord, build_spec
from ckptrun.cli.supervision.world import LocalWorld
from ckptrun.runtime.storage.ckpt_url import StoreUrl
from ckptrun.runtime.checkpoint.policies import Retention
from ckptrun.runtime.storage.remote_store import FsspecStore, ManifestUnreadable
from ckptrun.runtime.checkpoint.retention import apply_remote_retention
from ckptrun.runtime.storage import store
from ckptrun.runtime.storage.store import snapshot_name
from ckptrun.runtime.storage.store_backend import LocalStore
from ckptrun.runtime.checkpoint.tiering import choose
from ckptrun.runtime.checkpoint.verify import verify_snapshot
from ckptrun.runtime.storage.transfer import Retry, StoreUnavailable, copy_snapshot

ONCE = Retry(attempts=1)
SECRET = "S3CRET-do-not-write"


class OutageStore(FsspecStore):
    """A memory:// store that can go down: listings fail, or reads of some prefixes fail."""

    listing_down = False
    reads_down: tuple[str, ...] = ()  # prefix names whose objects cannot be read ("" = all)

    def prefixes(self):
        if self.listing_down:
            raise ConnectionError("could not connect to the endpoint")
        return super().prefixes()

    def open_read(self, name, relpath):
        if any(name.startswith(p) for p in self.reads_down):
            raise ConnectionError(f"read timeout on {name}/{relpath}")
        return super().open_read(name, relpath)


def memory_store(kind: type[FsspecStore] = OutageStore) -> FsspecStore:
    return kind(StoreUrl("memory", f"bucket-{uuid.uuid4().hex[:8]}/ckpt"))


def upload(tmp: Path, remote: FsspecStore, steps: list[int], make=make_snapshot) -> None:
    """Snapshots of one lineage, each the parent of the next, committed on ``remote``."""
    local, parent = tmp / "writer", None
    for step in steps:
        make(local, step, parent=parent)
        parent = snapshot_name(step)
    source = LocalStore(local)
    for item in source.published():
        copy_snapshot(source, item, remote, ONCE)


# --- finding 14: memory:// lists what it holds ------------------------------------------------------


def test_a_retry_repeats_a_storage_error_but_not_a_type_error():
    """A connection error may pass; a TypeError (an option the filesystem does not take) never does."""
    calls: list[str] = []

    def flaky() -> str:
        calls.append("try")
        if len(calls) < 3:
            raise ConnectionError("refused")
        return "done"

    assert Retry(attempts=4, base=0.0).run(flaky, "listing") == "done" and len(calls) == 3

    def misconfigured() -> None:
        calls.append("bad")
        raise TypeError("AioSession.__init__() got an unexpected keyword argument 'retries'")

    with pytest.raises(TypeError):
        Retry(attempts=4, base=0.0).run(misconfigured, "listing")
    assert calls.count("bad") == 1

def test_a_memory_store_lists_its_snapshots_and_line(tmp_path):
    remote = memory_store(FsspecStore)
    upload(tmp_path, remote, [5, 10])
    assert [p.step for p in remote.prefixes()] == [5, 10] and all(p.committed for p in remote.prefixes())
    assert [p.step for p in remote.line()] == [5, 10]


# --- finding 1: an outage is not "no snapshot" ----------------------------------------------------


def test_a_store_that_cannot_be_listed_is_unavailable_not_empty(tmp_path):
    remote = memory_store()
    upload(tmp_path, remote, [5])
    remote.listing_down = True
    source = SnapshotSource(tmp_path / "cache", remote, lambda _: None, lambda *a, **k: None, ONCE)
    with pytest.raises(SnapshotUnavailable, match="newest snapshot is unknown"):
        source.newest()
    with pytest.raises(SnapshotUnavailable):
        source.newest_step()


def test_a_failed_download_stops_instead_of_falling_back_to_an_older_snapshot(tmp_path):
    remote = memory_store()
    upload(tmp_path, remote, [5, 10])
    remote.reads_down = ("step-000000010",)
    with pytest.raises(StoreUnavailable, match="downloading .*step-000000010"):
        choose(remote, tmp_path / "cache", retry=ONCE)
    assert not LocalStore(tmp_path / "cache").published()  # step 5 was not restored instead


def test_a_manifest_the_store_fails_to_return_is_unknown_not_absent(tmp_path, monkeypatch):
    remote = memory_store()
    upload(tmp_path, remote, [5, 10])

    def down(path, *args, **kwargs):
        raise ConnectionError("throttled")

    monkeypatch.setattr(remote.fs, "cat_file", down)
    with pytest.raises(ManifestUnreadable):
        remote.published()


class StoreWorld(ScriptedWorld):
    """A scripted world whose snapshots come from a real :class:`SnapshotSource`."""

    source: SnapshotSource

    def newest_snapshot(self):
        return self.source.newest()

    restart_snapshot = newest_snapshot

    def newest_step(self):
        return self.source.newest_step()


def store_world(tmp_path: Path, script: dict, **kw) -> tuple[StoreWorld, OutageStore]:
    remote = memory_store()
    upload(tmp_path, remote, [5, 10])
    world = StoreWorld(script, **kw)
    world.source = SnapshotSource(tmp_path / "cache", remote, world.say, world.event, ONCE)
    return world, remote  # type: ignore[return-value]


def test_a_restart_during_an_outage_ends_resumably_instead_of_restarting_from_step_0(tmp_path):
    world, remote = store_world(tmp_path, {1: [training(T0 + 4, 12), training(T0 + 5, 12, agent_exit=1)]})
    remote.listing_down = True
    outcome = supervisor(world).supervise()
    assert outcome.code == 3 and "resume --latest" in (outcome.hint or "")
    assert world.launches == [(1, None)]  # no attempt 2 from nothing
    [gave_up] = world.events("gave_up")
    assert gave_up["exit_code"] == 3 and world.events("store_unavailable")


def stopped_world(tmp_path: Path) -> tuple[StoreWorld, OutageStore]:
    return store_world(tmp_path, {1: [training(T0 + 4, 8), training(T0 + 5, 9), training(T0 + 6, 9, agent_exit=1)]},
                       events_by_attempt={1: {"stopped": [{"step": 9}]}}, stop_signal_after=(1, 0))


def test_a_stop_reports_the_stores_newest_step_without_downloading_it(tmp_path):
    world, remote = stopped_world(tmp_path)
    remote.reads_down = ("",)  # any download would fail
    outcome = supervisor(world).supervise()
    assert outcome.code == 3 and "step 10" in outcome.message


def test_a_stop_during_an_outage_is_resumable_not_nothing_to_resume(tmp_path):
    world, remote = stopped_world(tmp_path)
    remote.listing_down = True
    outcome = supervisor(world).supervise()
    assert outcome.code == 3 and "unknown" in outcome.message  # not exit 1 "nothing to resume"


# --- finding 10: the memory tier's restart downloads only when it is used --------------------------


@pytest.mark.parametrize("memory_step", [12, 3])
def test_the_memory_tier_uses_the_listed_step_and_downloads_only_when_durable_wins(tmp_path, memory_step):
    remote = memory_store()
    upload(tmp_path, remote, [5, 10])
    remote.reads_down = ("",)
    memory = tmp_path / "shm"
    make_snapshot(memory, memory_step, run_id="r")
    events: list[str] = []
    world = LocalWorld.__new__(LocalWorld)  # the restart choice only: no processes, no run dir
    world.memory, world.ckpt_dir, world.run_id = MemoryDir(memory), tmp_path / "cache", "r"
    world.event, world.say = (lambda name, **_: events.append(name)), (lambda _: None)
    world.source = SnapshotSource(world.ckpt_dir, remote, world.say, world.event, ONCE)
    world.attempt_events = lambda name: []  # type: ignore[method-assign]  # the attempt quarantined nothing
    if memory_step > 10:
        chosen = world.restart_snapshot()
        assert isinstance(chosen, Snapshot) and chosen.step == 12  # nothing was downloaded (reads are down)
    else:
        with pytest.raises(SnapshotUnavailable, match="downloading"):  # durable step 10 wins: it is fetched
            world.restart_snapshot()


# --- finding 7: retention's gaps do not end the line ---------------------------------------------


def test_keep_every_deletes_between_milestones_and_the_line_still_reaches_them(tmp_path):
    remote = memory_store(FsspecStore)
    upload(tmp_path, remote, [5, 10, 15, 20, 25])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert apply_remote_retention(remote, Retention(keep_last=2, keep_every=10), run_dir) == [5, 15]
    assert [p.step for p in remote.line()] == [10, 20, 25]  # 20's parent (15) is gone; 10 stays on the line
    assert apply_remote_retention(remote, Retention(keep_last=2, keep_every=10), run_dir) == []


# --- findings 2 and 13: credentials given with --storage-option are never written -----------------


def test_storage_option_values_are_redacted_in_either_form():
    argv = ["ckptrun", "launch", "--storage-option", f"secret={SECRET}", f"--storage-option=key={SECRET}",
            "--storage-option", SECRET, "train.py", "--", "--lr", "3"]
    shown = redact_argv(argv)
    assert SECRET not in json.dumps(shown) and "secret=<redacted>" in shown and "--storage-option=key=<redacted>" in shown
    assert shown[-3:] == ["--", "--lr", "3"] and len(shown) == len(argv)


def test_nested_credentials_stay_out_of_run_json_and_reach_the_workers(tmp_path, monkeypatch):
    items = [f"client_kwargs.aws_secret_access_key={SECRET}", "client_kwargs.region_name=eu-west-1",
             "endpoint_url=http://minio:9000"]
    spec = build_spec({"ckpt_dir": "memory://bucket/x", "store_options": items})
    assert spec.store_options == {"client_kwargs": {"region_name": "eu-west-1"}, "endpoint_url": "http://minio:9000"}
    workers = json.loads(spec.worker_policy()["storage_options"])
    assert workers["client_kwargs"] == {"region_name": "eu-west-1", "aws_secret_access_key": SECRET}
    record = RunRecord(run_id="r", argv=["ckptrun", "launch", "--storage-option", items[0]], spec=spec)
    assert SECRET not in record.model_dump_json()
    monkeypatch.setattr(sys, "argv", ["ckptrun", "launch", f"--storage-option=secret={SECRET}"])
    paths = RunPaths(tmp_path / "run")
    with RunLock(paths):
        assert SECRET not in paths.holder_file.read_text()


def test_resume_takes_storage_options_over_the_stored_ones_and_keeps_credentials_apart():
    spec = build_spec({"ckpt_dir": "memory://bucket/x", "store_options": ["endpoint_url=http://minio:9000"]})
    options = resume_options(spec, [f"secret={SECRET}", "client_kwargs.region_name=eu"])
    resumed = build_spec({**spec.model_dump(), "store_options": options})
    assert resumed.store_options == {"endpoint_url": "http://minio:9000", "client_kwargs": {"region_name": "eu"}}
    assert resumed.store_secrets == {"secret": SECRET} and SECRET not in resumed.model_dump_json()
    with pytest.raises(CkptrunError, match="object-store"):
        resume_options(build_spec({}), ["secret=x"])


# --- a prefix two runs share: a run lists, chains, restores and deletes only its own snapshots ----------


def upload_run(tmp: Path, bucket: StoreUrl, run_id: str, steps: list[int], parent: str | None = None) -> FsspecStore:
    """Snapshots of run ``run_id``, each the parent of the next (the first's is ``parent``), committed in ``bucket``;
    the store bound to that run."""
    local = tmp / f"writer-{run_id}"
    for step in steps:
        make_snapshot(local, step, run_id=run_id, parent=parent)
        parent = snapshot_name(step)
    source, remote = LocalStore(local), FsspecStore(bucket, run_id=run_id)
    held = {p.digest for p in remote.committed()}
    for item in source.published():
        if item.digest not in held:
            copy_snapshot(source, item, remote, ONCE)
    return remote


def steps_of(items) -> list[tuple[int, str]]:
    return [(p.step, p.manifest.run_id) for p in items]


def test_a_shared_prefix_never_hands_one_run_the_others_snapshots(tmp_path):
    """Run b writes last, at steps run a has too, and its step 10 names a parent (step 5) it does not hold:
    unbound by run, the line would follow it into run a's step 5 and b's retention would delete it."""
    bucket = StoreUrl("memory", f"bucket-{uuid.uuid4().hex[:8]}/ckpt")
    a = upload_run(tmp_path, bucket, "run-a", [5, 10])
    b = upload_run(tmp_path, bucket, "run-b", [10, 15], parent=snapshot_name(5))
    assert steps_of(a.published()) == [(5, "run-a"), (10, "run-a")] and len(FsspecStore(bucket).published()) == 4
    assert steps_of(a.line()) == [(5, "run-a"), (10, "run-a")]
    assert steps_of(b.line()) == [(10, "run-b"), (15, "run-b")], "b's missing parent is not found in run a"
    assert steps_of(FsspecStore(bucket).line()) == steps_of(b.line()), "unbound: the run that wrote last, never a mix"
    chosen = choose(a, tmp_path / "cache-a", retry=ONCE)
    assert chosen is not None and chosen.step == 10 and chosen.digest == a.line()[-1].digest, "a restores its own 10"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert apply_remote_retention(b, Retention(keep_last=1), run_dir) == [10]
    assert steps_of(FsspecStore(bucket).published()) == [(5, "run-a"), (10, "run-a"), (15, "run-b")]


def test_a_fork_restores_the_parent_runs_snapshot_but_never_follows_or_deletes_that_run(tmp_path):
    bucket = StoreUrl("memory", f"bucket-{uuid.uuid4().hex[:8]}/ckpt")
    a = upload_run(tmp_path, bucket, "run-a", [5, 10])
    child = FsspecStore(bucket, run_id="run-b")
    child.fork(a.line()[-1].name)  # run b starts from run a's step 10
    assert steps_of(child.line()) == [(10, "run-a")], "the fork point, alone: a's step 5 is not on b's line"
    assert steps_of(a.line()) == [(5, "run-a"), (10, "run-a")], "b's fork marker is not a's"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert apply_remote_retention(child, Retention(keep_last=1), run_dir) == []
    upload_run(tmp_path, bucket, "run-b", [12, 14], parent=snapshot_name(10))  # b saves on from there
    assert steps_of(child.line()) == [(12, "run-b"), (14, "run-b")]
    assert apply_remote_retention(child, Retention(keep_last=1), run_dir) == [12]
    assert steps_of(a.published()) == [(5, "run-a"), (10, "run-a")], "nothing of run a deleted"


def test_a_local_store_bound_to_a_run_lists_only_that_runs_snapshots(tmp_path):
    make_snapshot(tmp_path / "ckpt", 5, run_id="run-a")
    make_snapshot(tmp_path / "ckpt", 10, run_id="run-b")
    assert [p.step for p in LocalStore(tmp_path / "ckpt", run_id="run-a").published()] == [5]
    assert [p.step for p in LocalStore(tmp_path / "ckpt").published()] == [5, 10]


# --- issue 24 item 3: a poisoned copy is dropped and the next tier tried ----------------------------


def test_a_snapshot_the_ranks_quarantined_as_poisoned_is_skipped_on_the_store_not_downloaded_again(tmp_path):
    """The ranks blamed step 10 (poison right after restoring its local copy) and moved that copy away; the
    store holds the same bytes, so the restart takes step 5, never a fresh download of 10 (which would be a
    second poisoned restore in a row: exit 4). Before: the source chose 10 again."""
    remote = memory_store()
    upload(tmp_path, remote, [5, 10])
    source = SnapshotSource(tmp_path / "cache", remote, lambda _: None, lambda *a, **k: None, ONCE)
    restored = source.newest()
    assert restored is not None and restored.step == 10
    moved = store.quarantine(restored.path, "poisoned", "loss nan at step 11", step=11, loss="nan")
    source.refuse_poisoned([{"event": "snapshot_quarantined", "cause": "unloadable", "moved_to": str(moved)}])
    assert source.newest().step == 10, "only a poisoned one is refused on the store"
    store.quarantine(source.newest().path, "poisoned", "loss nan at step 11")
    source.refuse_poisoned([{"event": "snapshot_quarantined", "cause": "poisoned", "moved_to": str(moved)}])
    assert (source.newest().step, source.newest_step()) == (5, 5)


# --- issue 24 item 6: a tiered restore hashes each byte once; a damaged local copy is fetched again ----


def test_a_restart_checks_the_local_copy_by_sizes_and_a_copy_damaged_at_load_is_fetched_again(tmp_path):
    """The supervisor's choice for a restart: the local copy of a chunked snapshot is taken on its manifest and
    sizes (the load hashes every chunk as it reads it, so the bytes are hashed once, not twice); when the
    load then finds a chunk that fails its digest, the copy is set aside and the same step downloaded again
    (hashed as it streams), not skipped for the older one; damage the store shares falls back to it.
    Before: the local copy was hashed whole before the load, and a digest failure refused the step."""
    remote, events = memory_store(), []
    upload(tmp_path, remote, [5, 10], make=make_chunked_snapshot)
    source = SnapshotSource(tmp_path / "cache", remote, lambda _: None, lambda name, **f: events.append(f), ONCE)
    assert source.newest().step == 10 and events[-1]["source"] == "remote"
    copy = tmp_path / "cache" / snapshot_name(10)
    data = bytearray((copy / "dcp/__0_0.safetensors").read_bytes())
    data[700] ^= 0x01
    (copy / "dcp/__0_0.safetensors").write_bytes(bytes(data))
    restored = source.newest()
    assert (restored.path, restored.step, events[-1]["source"]) == (copy, 10, "local-cache"), events[-1]
    assert "bytes verified at load" in events[-1]["reason"]
    found_at_load = "rank 0: DigestMismatch: dcp/__0_0.safetensors bytes 512..1024 (tensor 'w'): sha256 ab…, manifest says cd…"
    source.quarantine(restored.path, "corrupt", found_at_load)
    fetched = source.newest()
    assert (fetched.step, events[-1]["source"]) == (10, "remote"), "the same step again, from the store"
    assert verify_snapshot(fetched.path).ok, "the fresh download holds the store's good bytes"
    source.quarantine(fetched.path, "corrupt", found_at_load)  # a second failure of that step: its bytes are refused
    assert source.newest().step == 5
    source.quarantine(source.newest().path, "unloadable", "rank 0: KeyError: 'w'")  # not a digest: refused at once
    assert source.newest() is None
