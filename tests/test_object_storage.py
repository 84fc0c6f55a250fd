"""Snapshots on object storage, against a real S3 server (moto) on 127.0.0.1: same guarantees as a local dir.

Single-process runs of the default template (the upload's rank split is covered
by the 2-rank e2e test at the end). Each run uses a fresh bucket; the server
is shared by the module.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptrun.runtime.storage import ckpt_url
from ckptrun.runtime.checkpoint.policies import Retention
from ckptrun.runtime.records import final_losses, read_events, same_float
from ckptrun.runtime.storage.remote_store import chain, open_store
from ckptrun.runtime.checkpoint.retention import apply_remote_retention
from ckptrun.runtime.checkpoint.tiering import LOCAL, REMOTE, choose
from ckptrun.runtime.checkpoint.verify import verify_remote_dir
from ckptrun.cli import store_location
from ports import free_port
from s3_server import S3Server, serving
from snapshot_factory import flip_byte
from workers import run_id_for, run_job, shared_tensors

FAST = ("--num-workers", "0", "--hidden", "128")


@pytest.fixture(scope="module")
def s3(tmp_path_factory) -> S3Server:
    with serving(tmp_path_factory.mktemp("moto") / "moto.log") as server:
        yield server


def job(run_dir: Path, url: str, steps: int = 12, **fields):
    fields.setdefault("save_every_steps", 5)
    fields.setdefault("ckpt_dir", run_dir / "staging")
    return run_job(run_dir, args=("--steps", str(steps), *FAST), ckpt_url=url, **fields)


def committed(url: str) -> list[int]:
    store = open_store(url)
    return [p.step for p in store.published()]


def assert_same_losses(run_dir: Path, reference: tuple[Path, str]) -> None:
    got, want = final_losses(run_dir), final_losses(reference[0])
    assert sorted(got) == sorted(want)
    assert all(same_float(got[s], want[s]) for s in want), "losses differ from the uninterrupted run"


def assert_same_tensors(url: str, expected_url: str, scratch: Path) -> None:
    """The newest committed snapshots of two locations hold the same tensors, bitwise."""
    fetched, expected = choose(open_store(url), scratch / "got"), choose(open_store(expected_url), scratch / "want")
    assert fetched is not None and expected is not None and fetched.step == expected.step
    got, want = shared_tensors(fetched.path), shared_tensors(expected.path)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want), "tensors differ from the uninterrupted run"


@pytest.fixture(scope="module")
def reference(tmp_path_factory, s3) -> tuple[Path, str]:
    """The uninterrupted 12-step run on S3, keeping 2: the losses and tensors every resume must match,
    and the committed snapshots (10, 12) the corruption tests damage copies of."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    url = f"s3://{s3.new_bucket()}/ckpt"
    result = job(run_dir, url, keep_last=2)
    assert result.returncode == 0, result.stderr
    return run_dir, url


@pytest.fixture(scope="module")
def killed_tiered(tmp_path_factory, s3) -> tuple[Path, str]:
    """A tiered run (local cache + S3) killed at step 7: step 5 is in the cache and committed on S3."""
    run_dir = tmp_path_factory.mktemp("tiered") / "run"
    url = f"s3://{s3.new_bucket()}/ckpt"
    assert job(run_dir, url, ckpt_dir=run_dir / "cache", local_cache=True, fault="kill:rank=0:step=7").returncode == -9
    assert (run_dir / "cache" / "step-000000005").is_dir() and committed(url) == [5]
    return run_dir, url


def copy_bucket(source: str, s3: S3Server) -> str:
    """A private copy of a finished run's objects, for a test that damages them."""
    target = f"s3://{s3.new_bucket()}/ckpt"
    fs = open_store(source).fs
    for path in fs.find(source.removeprefix("s3://")):
        fs.copy(path, target.removeprefix("s3://") + path[len(source.removeprefix("s3://")):])
    return target


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptrun.cli.main", *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd)


# --- URLs -------------------------------------------------------------------------


def test_urls_are_parsed_or_refused_never_a_local_dir_named_s3():
    assert ckpt_url.parse("s3://bucket/a/b/") == ckpt_url.StoreUrl("s3", "bucket/a/b")
    assert ckpt_url.parse("file:///tmp/x") == Path("/tmp/x") and ckpt_url.parse("rel/dir") == Path("rel/dir")
    with pytest.raises(ckpt_url.UrlError, match="slash missing"):
        ckpt_url.parse("s3:/bucket/x")  # what pathlib makes of s3://bucket/x
    with pytest.raises(ckpt_url.UrlError, match="gcsfs") as refused:
        ckpt_url.parse("gs://bucket/x")
    assert "pip install gcsfs" in refused.value.hint
    with pytest.raises(ckpt_url.UrlError, match="not a storage protocol"):
        ckpt_url.parse("nosuch://bucket/x")
    assert ckpt_url.parse_storage_options(["endpoint_url=http://h:1", "client_kwargs.region_name=eu", "anon=false"]) == {
        "endpoint_url": "http://h:1", "client_kwargs": {"region_name": "eu"}, "anon": False}


# --- save, kill, resume --------------------------------------------------------------


@pytest.mark.timeout(180)
def test_kill_and_resume_from_s3_is_bitwise_exact(tmp_path, s3, reference):
    url, run_dir = f"s3://{s3.new_bucket()}/ckpt", tmp_path / "run"
    assert job(run_dir, url, fault="kill:rank=0:step=7").returncode == -9
    assert committed(url) == [5]
    assert not list((run_dir / "staging").glob("step-*")), "staging is emptied once the store holds the snapshot"
    resumed = job(run_dir, url, attempt=2)
    assert resumed.returncode == 0, resumed.stderr
    source = read_events(run_dir, "restore_source")[-1]
    assert source["source"] == REMOTE and source["step"] == 5
    assert [e["step"] for e in read_events(run_dir, "restored")] == [5]
    assert committed(url) == [5, 10, 12]
    assert_same_losses(run_dir, reference)
    assert_same_tensors(url, reference[1], tmp_path / "fetched")


@pytest.mark.timeout(120)
def test_kill_during_upload_leaves_no_manifest_and_restore_uses_the_previous(tmp_path, s3):
    url, run_dir = f"s3://{s3.new_bucket()}/ckpt", tmp_path / "run"
    assert job(run_dir, url, fault="kill-during-save:phase=before-commit:step=10").returncode == -9
    store = open_store(url)
    prefixes = {p.step: p for p in store.prefixes()}
    assert prefixes[5].committed and not prefixes[10].committed, "every object of step 10 is up, its manifest is not"
    assert set(prefixes[10].objects) >= {"state.json", "dcp/__0_0.safetensors"}
    statuses = {r.step: r.status for r in verify_remote_dir(store)}
    assert statuses == {5: "ok", 10: "in-progress"}
    picked = choose(store, tmp_path / "cache")
    assert picked is not None and picked.step == 5


# --- corruption ------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["flipped-byte", "truncated"])
def test_a_changed_object_is_caught_by_verify_and_skipped_by_restore(tmp_path, s3, reference, damage):
    store = open_store(copy_bucket(reference[1], s3))
    newest = chain(store.published())[-1]
    path = store.url.join(newest.name, "dcp/__0_0.safetensors")
    data = bytearray(store.fs.cat_file(path))
    if damage == "flipped-byte":
        data[len(data) // 2] ^= 0x01
    store.fs.pipe_file(path, bytes(data if damage == "flipped-byte" else data[:100]))
    result = cli("verify", store.where, "--json")
    assert result.returncode == 1, result.stderr
    report = {s["step"]: s for s in json.loads(result.stdout)["snapshots"]}
    assert report[12]["status"] == "corrupt" and "dcp/__0_0.safetensors" in " ".join(report[12]["problems"])
    assert report[10]["status"] == "ok"
    said: list[str] = []
    picked = choose(store, tmp_path / "cache", log=said.append)
    assert picked is not None and picked.step == 10 and picked.source == REMOTE
    assert any("skipping" in line and newest.name in line for line in said)
    assert store.fs.exists(path), "a corrupt snapshot is reported, never deleted"


def test_verify_exit_codes_match_a_local_dir_and_unusable_urls_are_refused(s3, reference, tmp_path):
    assert cli("verify", reference[1]).returncode == 0
    assert cli("verify", f"s3://{s3.new_bucket()}/nothing").returncode == 2
    for command in (("verify", "gs://bucket/ckpt"), ("launch", "--ckpt-dir", "gs://bucket/ckpt"),
                    ("launch", "--ckpt-dir", "s3:/bucket/ckpt"), ("estimate-rto", "gs://bucket/ckpt")):
        refused = cli(*command, cwd=tmp_path)
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, (command, refused.stderr)
        assert "gcsfs" in refused.stderr or "slash missing" in refused.stderr
    assert not list(tmp_path.iterdir()), "nothing is created, least of all a directory named gs: or s3:"


@pytest.mark.timeout(60)
def test_a_store_that_cannot_be_written_is_refused_at_launch(s3, tmp_path):
    """A missing bucket lists as empty: only a real write + delete finds it (issue 24). Before: 192 steps
    trained, exit 0, and no snapshot anywhere."""
    refused = cli("launch", "--nproc-per-node", "1", "--ckpt-dir", "s3://ckptrun-no-such-bucket-24/x", "--",
                  "--steps", "2", cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.startswith("error: cannot write to s3://ckptrun-no-such-bucket-24/x") and "hint: " in refused.stderr
    assert "The specified bucket does not exist" in refused.stderr, refused.stderr  # refused for the bucket, not else
    assert "Traceback" not in refused.stderr and not list(tmp_path.glob("runs/*/run.json"))
    writable = f"s3://{s3.new_bucket()}/ckpt"
    probe = store_location.open_store(writable)
    store_location.probe_writable(probe)
    assert not probe.fs.find(writable.removeprefix("s3://")), "the probe leaves nothing behind"


@pytest.mark.timeout(60)
def test_a_storage_option_the_filesystem_does_not_take_is_named_in_one_line(s3, tmp_path):
    """s3fs hands unknown options down to its session as keywords: the TypeError it raises became
    "cannot list …: TypeError: AioSession.__init__() got an unexpected keyword argument" (and a save
    retried it four times). Each command that opens the store names the option instead."""
    url = f"s3://{s3.new_bucket()}/ckpt"
    for command in (("launch", "--ckpt-dir", url, "--storage-option", "retries=1", "--", "--steps", "2"),
                    ("verify", url, "--storage-option", "retries=1"),
                    ("estimate-rto", url, "--storage-option", "retries=1")):  # a restore's listing: wrapped
        refused = cli(*command, cwd=tmp_path)
        assert refused.returncode == 2, (command, refused.stderr)
        assert refused.stderr.splitlines() == [
            f"error: {url}: --storage-option retries is not an option of the s3 filesystem",
            "hint: drop it, or nest it where the filesystem takes it (e.g. config_kwargs.retries.max_attempts=2 for s3)"]
    assert not list(tmp_path.glob("runs/*/run.json"))


# --- retention --------------------------------------------------------------------------


def test_retention_on_s3_keeps_k_and_never_deletes_before_a_newer_verified_manifest(tmp_path, s3, reference):
    run_dir, url = reference
    assert committed(url) == [10, 12], "--keep-last 2"
    assert [e["step"] for e in read_events(run_dir, "snapshot_deleted")] == [5]
    # The newest snapshot does not check out: nothing is deleted.
    store = open_store(copy_bucket(url, s3))
    store.fs.rm_file(store.url.join(chain(store.published())[-1].name, "state.json"))
    (tmp_path / "events").mkdir()
    assert apply_remote_retention(store, Retention(keep_last=1), tmp_path / "events") == []
    assert [p.step for p in store.published()] == [10, 12]
    assert read_events(tmp_path / "events", "retention_skipped")
    # An interrupted upload (a prefix without a manifest) is garbage once old enough, and only then; and only
    # this run's: a racing run's upload in flight on the same location is never touched (issue 24).
    store = open_store(store.where, None, run_id_for(run_dir))
    mine, racing = store.open_new(15), open_store(store.where, None, "a-racing-run").open_new(15)
    for name in (mine, racing):
        store.fs.pipe_file(store.url.join(name, "state.json"), b"{}")
    apply_remote_retention(store, Retention(keep_last=5), tmp_path / "events")
    assert {mine, racing} <= {p.name for p in store.prefixes()}
    apply_remote_retention(store, Retention(keep_last=5), tmp_path / "events", now=4e9)
    left = {p.name for p in store.prefixes()}
    assert mine not in left and racing in left, "only this run's interrupted upload is garbage"
    assert [e["path"].rsplit("/", 1)[-1] for e in read_events(tmp_path / "events", "garbage_deleted")] == [mine]
    assert open_store(store.where).garbage(0.0, now=4e9) == [], "a store bound to no run collects nothing"


def test_a_fork_marker_ends_the_line_at_its_fork_point_and_deletes_nothing(s3, reference):
    store = open_store(copy_bucket(reference[1], s3))
    older, newer = store.line()
    store.fork(older.name)
    assert [p.name for p in store.line()] == [older.name]
    assert {r.step: r.abandoned for r in verify_remote_dir(store, quick=True)} == {10: False, 12: True}
    store.fork(None)
    assert store.line() == [] and len(store.published()) == 2


# --- tiering ----------------------------------------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize("cache_lost", [False, True], ids=["local-copy", "local-copy-lost"])
def test_tiered_restart_uses_the_local_copy_else_s3_both_exact(tmp_path, s3, reference, killed_tiered, cache_lost):
    run_dir, url = tmp_path / "run", copy_bucket(killed_tiered[1], s3)
    shutil.copytree(killed_tiered[0], run_dir)
    if cache_lost:
        shutil.rmtree(run_dir / "cache")
    # the copy resumes as the same run (a store lists, chains and restores only its run's snapshots)
    resumed = job(run_dir, url, ckpt_dir=run_dir / "cache", local_cache=True, attempt=2, run_id=run_id_for(killed_tiered[0]))
    assert resumed.returncode == 0, resumed.stderr
    source = read_events(run_dir, "restore_source")[-1]
    assert source["source"] == (REMOTE if cache_lost else LOCAL) and source["step"] == 5, source
    assert_same_losses(run_dir, reference)
    assert committed(url) == [5, 10, 12]


@pytest.mark.timeout(180)
def test_a_local_copy_damaged_at_load_is_fetched_again_from_s3_and_the_resume_is_exact(tmp_path, s3, reference,
                                                                                      killed_tiered):
    """Issue 24 item 6: the local copy of step 5 has a flipped byte. The restore takes it on sizes (no hash
    before the load), the load catches the chunk, the copy is set aside and step 5 downloaded again: the
    resume is exact from step 5, not from step 0 (there is no older snapshot). Before: the copy was hashed
    whole before the load."""
    run_dir, url = tmp_path / "run", copy_bucket(killed_tiered[1], s3)
    shutil.copytree(killed_tiered[0], run_dir)
    flip_byte(run_dir / "cache" / "step-000000005" / "dcp" / "__0_0.safetensors")
    resumed = job(run_dir, url, ckpt_dir=run_dir / "cache", local_cache=True, attempt=2, run_id=run_id_for(killed_tiered[0]))
    assert resumed.returncode == 0, resumed.stderr
    sources = [(e["source"], e["step"]) for e in read_events(run_dir, "restore_source") if e.get("attempt", 2) == 2][-2:]
    assert sources == [(LOCAL, 5), (REMOTE, 5)], sources
    failed, = [e for e in read_events(run_dir, "restore_failed") if e.get("attempt") == 2]
    assert "DigestMismatch" in failed["reason"], failed
    set_aside, = [e for e in read_events(run_dir, "snapshot_quarantined") if e.get("attempt") == 2]
    assert (set_aside["tier"], set_aside["cause"]) == (LOCAL, "digest") and Path(set_aside["moved_to"]).is_dir()
    assert_same_losses(run_dir, reference)


# --- failures ----------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_an_unreachable_store_fails_the_save_and_training_goes_on(tmp_path, s3):
    dead = json.dumps({"endpoint_url": f"http://127.0.0.1:{free_port()}", "config_kwargs": {"retries": {"max_attempts": 1}}})
    run_dir = tmp_path / "run"
    result = job(run_dir, f"s3://{s3.new_bucket()}/ckpt", steps=6, storage_options=dead, max_failed_saves=10,
                 supervised=True)  # supervised: the supervisor (not this worker) lists the store before a restore
    assert result.returncode == 1, result.stderr  # training went on; a final save that fails is not completion
    assert "the final save at step 6 failed: no snapshot of this attempt published" in result.stderr
    failed = read_events(run_dir, "save_failed")
    assert [e["step"] for e in failed] == [5, 6], failed  # failed for the dead endpoint, not for anything else
    assert all("upload" in e["error"] and "Could not connect to the endpoint URL" in e["error"] for e in failed), failed
    assert not read_events(run_dir, "snapshot_saved")
    assert not list((run_dir / "staging").glob("step-*")), "a local copy the store does not hold is not kept"


@pytest.mark.timeout(180)
def test_a_restart_from_the_final_snapshot_leaves_no_snapshot_in_staging(tmp_path, s3):
    """Staging holds a snapshot only while it uploads: a restart's download that is never saved again (the
    run restarts from its final snapshot, nothing left to train) is removed when the run ends; lineage.json stays."""
    run_dir, url = tmp_path / "run", f"s3://{s3.new_bucket()}/ckpt"
    first = job(run_dir, url, steps=10)
    assert first.returncode == 0, first.stderr
    assert sorted(p.name for p in (run_dir / "staging").iterdir()) == ["lineage.json"]
    again = job(run_dir, url, steps=10, attempt=2)
    assert again.returncode == 0, again.stderr
    source = read_events(run_dir, "restore_source")[-1]
    assert (source["source"], source["step"]) == (REMOTE, 10), "downloaded into staging; nothing to train, no save"
    assert sorted(p.name for p in (run_dir / "staging").iterdir()) == ["lineage.json"]
    assert committed(url) == [5, 10]


# --- the commands, end to end ----------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_launch_on_s3_recovers_from_the_store_and_every_command_takes_the_url(tmp_path, s3):
    """2 ranks under `ckptrun launch --ckpt-dir s3://…`: each rank uploads its own files, a crash restarts from
    the store, and verify / status / estimate-rto / export / resume work on the URL or the run."""
    from launch_helpers import Cleanup, assert_no_processes, ckptrun

    cleanup, url = Cleanup(), f"s3://{s3.new_bucket()}/ckpt"
    run_dir = cleanup.run_dir(tmp_path / "runs" / "s3")
    try:
        result = ckptrun("launch", "--nproc-per-node", "2", "--save-every-steps", "5", "--heartbeat-timeout", "5",
                         "--startup-timeout", "60", "--restart-backoff", "0.1", "--name", "s3", "--ckpt-dir", url,
                         "--storage-option", "max_concurrency=4", "--inject-fault", "kill:rank=1:step=7",
                         "--", "--steps", "12", *FAST, cwd=tmp_path, timeout=280)
        assert result.returncode == 0, result.stderr[-3000:]
        source = read_events(run_dir, "restore_source")[-1]
        assert source["source"] == REMOTE and source["step"] == 5, source
        assert committed(url) == [5, 10, 12]
        newest = chain(open_store(url).published())[-1]
        assert {f.rank for f in newest.manifest.files} == {0, 1}, "each rank uploads what it wrote"
        assert "max_concurrency" in (run_dir / "run.json").read_text()
        assert cli("verify", url).returncode == 0
        status = subprocess.run([sys.executable, "-m", "ckptrun.cli.main", "status", str(run_dir), "--json"],
                                capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["snapshot"]["path"].startswith(url + "/step-000000012-")
        staging = sorted(p.name for p in (run_dir / "staging").iterdir())
        assert staging == ["lineage.json"], "no snapshot stays in staging: every upload's commit removes its own"
        estimate = cli("estimate-rto", str(run_dir), "--json", cwd=tmp_path)  # its store (a URL: test_messages_cli)
        assert estimate.returncode == 0, estimate.stderr
        components = json.loads(estimate.stdout)["components"]
        assert components["verify"]["source_of_restore"] == REMOTE
        on_url = cli("estimate-rto", url, "--json", cwd=tmp_path)  # no history: a no-op relaunch times the restart
        assert on_url.returncode == 0, on_url.stderr
        assert json.loads(on_url.stdout)["components"]["restart"]["noop_opened_store"] is True, \
            "the no-op relaunch's ranks opened the store's client, as the run's ranks do"
        for source in (url, str(run_dir)):  # the store's newest, downloaded (a run dir: its store) to a temporary dir
            exported = cli("export", source, "-o", str(tmp_path / "model.pt"))
            assert exported.returncode == 0 and (tmp_path / "model.pt").stat().st_size > 0, exported.stderr
        assert sorted(p.name for p in (run_dir / "staging").iterdir()) == staging and not (run_dir / "checkpoints").exists(), \
            "reading the run leaves no copy in its dir"
        from ckptrun.cli.supervision.runner import _newest
        from ckptrun.cli.supervision.spec import build_spec

        picked = _newest(tmp_path / "fresh-node", build_spec({"ckpt_dir": url}))  # what `resume --latest` starts from
        assert picked.step == 12 and picked.path.parent == tmp_path / "fresh-node"
        again = ckptrun("resume", "--latest", "--run-dir", str(run_dir), cwd=tmp_path, timeout=120)
        assert again.returncode == 0 and "already completed" in again.stdout + again.stderr
        refused = ckptrun("launch", "--name", "s3b", "--ckpt-dir", url, cwd=tmp_path, timeout=60)
        assert refused.returncode == 2 and "already holds snapshots" in refused.stderr
        assert_no_processes(run_dir)
    finally:
        cleanup.close()


def test_a_store_that_never_got_a_snapshot_has_nothing_to_resume_as_a_local_dir_says(s3: S3Server, tmp_path: Path) -> None:
    """Found by the scenario matrix (1x2/unwrapped/s3/supervisor-kill before the first snapshot): `resume` said
    "no snapshot in s3://… verifies", exit 1, where a local checkpoint dir says there is nothing to resume
    from, exit 2. A store this run never committed to says the same as the local dir; one whose snapshots all
    fail still says none verifies (exit 1)."""
    from ckptrun.cli.errors import CkptrunError

    empty = store_location.open_store(f"s3://{s3.new_bucket()}/ckpt")
    with pytest.raises(CkptrunError) as refused:
        store_location.fetch_newest(empty, tmp_path / "cache")
    assert refused.value.exit_code == 2 and "nothing to resume from" in str(refused.value.hint), refused.value
