"""Snapshot invariants with real processes and real files: atomic, verified, safe, nothing lost.

Single-process runs of the default template (the ranks are not the point here;
test_exactness covers 2 ranks). Each test damages real files or kills a real
process at a real save phase.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ckptrun.runtime.storage import store
from ckptrun.runtime.manifest import read_manifest
from ckptrun.runtime.records import read_events, read_fatal
from ckptrun.runtime.checkpoint.verify import newest_verified, verify_dir
from snapshot_factory import flip_byte, plant_pickle
from workers import run_job

FIXTURES = Path(__file__).parent / "fixtures"
FAST = ("--num-workers", "0", "--hidden", "128")


def job(run_dir: Path, steps: int = 12, extra: tuple[str, ...] = (), **fields):
    fields.setdefault("save_every_steps", 5)
    return run_job(run_dir, args=("--steps", str(steps), *FAST, *extra), **fields)


def published_steps(ckpt_dir: Path) -> list[int]:
    return [e.step for e in store.list_entries(ckpt_dir, include_abandoned=False) if e.kind == "published"]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptrun.cli.main", *args], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def source_run(tmp_path_factory) -> Path:
    """A finished run with snapshots at steps 5 and 10."""
    run_dir = tmp_path_factory.mktemp("source") / "src"
    result = job(run_dir, steps=10)
    assert result.returncode == 0, result.stderr
    assert published_steps(run_dir / "checkpoints") == [5, 10]
    return run_dir


def copy_run(source: Path, target: Path) -> Path:
    shutil.copytree(source / "checkpoints", target / "checkpoints")
    return target


# --- atomicity ------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("phase", ["stage", "persist", "before-manifest", "before-publish"])
def test_kill_during_any_save_phase_never_publishes_a_partial_snapshot(tmp_path, phase):
    run_dir = tmp_path / "run"
    killed = job(run_dir, fault=f"kill-during-save:phase={phase}:step=10")
    assert killed.returncode == -9
    ckpt = run_dir / "checkpoints"
    assert published_steps(ckpt) == [5]
    assert all(r.status in ("ok", "in-progress") for r in verify_dir(ckpt))
    resumed = job(run_dir, attempt=2)
    assert resumed.returncode == 0, resumed.stderr
    assert [e["step"] for e in read_events(run_dir, "restored")] == [5]
    assert published_steps(ckpt) == [5, 10, 12]
    assert not list(ckpt.glob(".step-*")), "leftover temp dirs are cleaned"


# --- corruption and safety ----------------------------------------------------------


def edit_manifest(snapshot: Path, change) -> None:
    document = json.loads((snapshot / "manifest.json").read_text())
    change(document)
    (snapshot / "manifest.json").write_text(json.dumps(document))


def set_path(document, old, new):
    next(f for f in document["files"] if f["path"] == old)["path"] = new


CORRUPTIONS = {
    "flipped-byte": (lambda s: flip_byte(s / "dcp" / "__0_0.safetensors"), "corrupt", "dcp/__0_0.safetensors: sha256"),
    "truncated": (lambda s: (s / "rank-00000.safetensors").write_bytes((s / "rank-00000.safetensors").read_bytes()[:100]), "corrupt", "rank-00000.safetensors: size 100"),
    "missing-file": (lambda s: (s / "state.json").unlink(), "incomplete", "state.json: missing"),
    "garbage-manifest": (lambda s: (s / "manifest.json").write_text("{not json"), "corrupt", "manifest.json: invalid"),
    "schema-invalid": (lambda s: edit_manifest(s, lambda d: d.update(schema_version=99)), "corrupt", "schema version 99"),
    "path-outside": (lambda s: edit_manifest(s, lambda d: set_path(d, "state.json", "../outside")), "corrupt", "leaves the snapshot directory"),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_damaged_snapshot_is_caught_and_restore_falls_back(source_run, tmp_path, kind):
    damage, status, problem = CORRUPTIONS[kind]
    ckpt = copy_run(source_run, tmp_path / "run") / "checkpoints"
    damage(ckpt / "step-000000010")
    result = cli("verify", str(ckpt), "--json")
    assert result.returncode == 1
    report = {s["step"]: s for s in json.loads(result.stdout)["snapshots"]}
    assert report[10]["status"] == status and problem in " ".join(report[10]["problems"])
    assert report[5]["status"] == "ok"
    said: list[str] = []
    chosen = newest_verified(ckpt, log=said.append)
    assert chosen is not None and chosen.step == 5
    assert any("skipping step-000000010" in line for line in said)
    assert (ckpt / "step-000000010").exists(), "a corrupt snapshot is reported, never deleted"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("relative", ["rank-00000.safetensors", "dcp/metadata.json"])
def test_malicious_pickle_with_matching_digest_never_runs(source_run, tmp_path, relative):
    run_dir = copy_run(source_run, tmp_path / "run")
    marker = tmp_path / "marker"
    plant_pickle(run_dir / "checkpoints" / "step-000000010", relative, marker)
    assert cli("verify", str(run_dir / "checkpoints")).returncode == 0, "digests match: integrity is not trust"
    result = job(run_dir, attempt=2)
    assert result.returncode == 0, result.stderr
    assert not marker.exists(), "the malicious pickle ran"
    assert "snapshot step-000000010 does not load" in result.stderr
    assert [e["step"] for e in read_events(run_dir, "restored")] == [5]
    assert [e["snapshot"].endswith("step-000000010") for e in read_events(run_dir, "restore_failed")] == [True]


# --- lineage and retention -------------------------------------------------------------


@pytest.mark.timeout(120)
def test_resume_from_older_snapshot_forks_and_keeps_the_abandoned_line(tmp_path):
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints"
    assert job(run_dir, steps=20, keep_last=3).returncode == 0
    assert published_steps(ckpt) == [10, 15, 20]
    old_line = store.read_lineage(ckpt).current
    store.fork(ckpt, ckpt / "step-000000010")
    new_line = store.read_lineage(ckpt).current
    assert published_steps(ckpt) == [10]
    abandoned = sorted(p.name for p in (ckpt / "abandoned" / old_line).iterdir())
    assert abandoned == ["step-000000015", "step-000000020"]

    result = job(run_dir, steps=30, attempt=2, keep_last=2)
    assert result.returncode == 0, result.stderr
    assert [e["step"] for e in read_events(run_dir, "restored")] == [10]
    assert published_steps(ckpt) == [25, 30]
    assert {read_manifest(ckpt / store.snapshot_name(s)).lineage for s in (25, 30)} == {new_line}
    assert sorted(p.name for p in (ckpt / "abandoned" / old_line).iterdir()) == abandoned, "abandoned line untouched"
    assert newest_verified(ckpt).step == 30
    reports = {(r.step, r.abandoned) for r in verify_dir(ckpt)}
    assert reports == {(15, True), (20, True), (25, False), (30, False)}


@pytest.mark.timeout(60)
def test_retention_keeps_last_k_and_milestones(tmp_path):
    run_dir = tmp_path / "run"
    assert job(run_dir, steps=30, keep_last=2, keep_every=10).returncode == 0
    assert published_steps(run_dir / "checkpoints") == [10, 20, 25, 30]
    deleted = [e["step"] for e in read_events(run_dir, "snapshot_deleted")]
    assert sorted(deleted) == [5, 15]


@pytest.fixture
def small_disk(tmp_path):
    """A 24 MiB tmpfs (room for one ~13 MB snapshot plus margin, not two) where permitted, else None."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount_point)], capture_output=True).returncode == 0
    yield mount_point if mounted else None
    if mounted:
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["full-disk", "enospc-while-writing"])
def test_disk_full_keeps_the_previous_snapshot_and_stops_after_three_failures(tmp_path, small_disk, how):
    """A full disk is refused by the preflight (a skipped save); an ENOSPC while writing fails the save.
    Either way the previous snapshot stays verified and the third failure in a row stops the run (exit 1)."""
    run_dir = tmp_path / "run"
    args = ("--steps", "20", "--num-workers", "0")
    if how == "full-disk" and small_disk is None:
        pytest.skip("mounting a tmpfs is not permitted here; the injected ENOSPC case covers the write path")
    if how == "full-disk":
        ckpt = small_disk / "checkpoints"
        result = run_job(run_dir, args=args, ckpt_dir=ckpt, save_every_steps=2)
        failure_event = "save_skipped"
    else:
        ckpt = run_dir / "checkpoints"
        result = run_job(run_dir, args=args, save_every_steps=2, fault="enospc:step=4")
        failure_event = "save_failed"
    assert result.returncode == 1, result.stderr
    assert "SAVE FAILED at step 4" in result.stderr and "MiB free in" in result.stderr
    assert published_steps(ckpt) == [2]
    assert [r.status for r in verify_dir(ckpt)] == ["ok"]
    assert [e["step"] for e in read_events(run_dir, failure_event)] == [4, 6, 8]
    assert read_fatal(run_dir)[0]["exit_code"] == 1
    assert "3 consecutive saves failed" in result.stderr


# --- config ----------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_changed_hyperparameter_is_refused_naming_it(source_run, tmp_path):
    run_dir = copy_run(source_run, tmp_path / "run")
    refused = job(run_dir, attempt=2, extra=("--lr", "0.01"))
    assert refused.returncode == 4
    assert "config changed since snapshot step 10 (lr: 0.003 -> 0.01)" in refused.stderr
    assert "lr" in read_fatal(run_dir)[0]["reason"]
    allowed = job(run_dir, attempt=3, extra=("--lr", "0.01"), allow_changes=("lr",))
    assert allowed.returncode == 0, allowed.stderr


# --- data position -----------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_resume_fast_forwards_without_loading_consumed_samples(tmp_path):
    run_dir = tmp_path / "run"
    script = FIXTURES / "counting_job.py"
    killed = run_job(run_dir, script=script, save_every_steps=5, fault="kill:step=7")
    assert killed.returncode == -9
    assert run_job(run_dir, script=script, save_every_steps=5, attempt=2).returncode == 0
    pairs = [tuple(map(int, line.split())) for line in (run_dir / "loaded.txt").read_text().splitlines()]
    assert [index for attempt, index in pairs if attempt == 1] == list(range(0, 28)), "7 steps x 4 before the kill"
    second = [index for attempt, index in pairs if attempt == 2]
    assert second == list(range(20, 48)), "resumed at sample 20 (5 steps x 4), loads exactly 20..47"
