"""The sync-save write path, sped up without giving up a guarantee (issue 13, item 3).

What the faster path skips — collectives in a world of one, re-planning an unchanged layout, the zip
CRC that our digests make redundant, one-at-a-time fsyncs — and what it must keep: every file durable
before the manifest is written, the manifest and its directory durable before the rename, the parent
fsynced after it; every rank reaching the same plan-cache verdict. Real files, real fsyncs (observed,
never replaced), real gloo ranks in subprocesses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest
import torch
from ports import free_port

from ckptrun.runtime.checkpoint import snapshot, zip_crc
from ckptrun.runtime.storage import store
from ckptrun.runtime.checkpoint.saver import Saver
from ckptrun.runtime.checkpoint.treecodec import split
from ckptrun.runtime.checkpoint.writeback import StreamingFile

ROOT = Path(__file__).resolve().parent.parent


def save(ckpt_dir: Path, step: int) -> snapshot.SaveResult:
    """One sync save of a small state in this process (no process group: a world of one)."""
    lineage = store.ensure_lineage(ckpt_dir, "save-path")
    torch.manual_seed(step)
    tree, tensors = split({"w": torch.randn(1000), "b": torch.randn(3, 5)}, "model")
    state = snapshot.State({"objects": {"model": tree}, "counters": {"step": step}}, tensors, {"rng": {}}, {"rng.torch": torch.randn(7)})
    info = snapshot.SnapshotInfo("save-path", lineage.current, None, step, 0, 0, "fp32", {}, "")
    results: list[snapshot.SaveResult] = []
    Saver(ckpt_dir, "sha256", asynchronous=False).begin(state, info, lambda phase: None, results.append)
    assert results[0].ok, results[0].error
    return results[0]


def test_files_are_durable_before_the_manifest_which_is_durable_before_the_rename(tmp_path, monkeypatch):
    events: list[tuple[str, str]] = []  # in the order they finished (fsync) or began (manifest, rename)
    inodes: dict[int, int] = {}  # inode -> index of its fsync event (DCP fsyncs .metadata under a temp name)
    lock = threading.Lock()
    real_fsync, real_rename, real_write_manifest = os.fsync, os.rename, store.write_manifest

    def note(kind: str, path: str, inode: int = 0) -> None:
        with lock:
            inodes[inode] = len(events)
            events.append((kind, path))

    def fsync(fd: int) -> None:
        path, inode = os.readlink(f"/proc/self/fd/{fd}"), os.fstat(fd).st_ino
        real_fsync(fd)
        note("fsync", path, inode)

    def rename(source, target) -> None:
        note("rename", str(source))
        real_rename(source, target)

    def write_manifest(temp_dir, manifest) -> None:
        note("manifest", str(temp_dir))
        real_write_manifest(temp_dir, manifest)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(store, "write_manifest", write_manifest)
    final = save(tmp_path / "ckpt", 1).path
    [(_, temp)] = [e for e in events if e[0] == "manifest"]
    when = {path: i for i, (kind, path) in enumerate(events) if kind == "fsync"}
    manifest_at = events.index(("manifest", temp))
    rename_at = events.index(("rename", temp))
    for file in sorted(p for p in final.rglob("*") if p.is_file() and p.name != "manifest.json"):
        assert inodes.get(file.stat().st_ino, len(events)) < manifest_at, f"{file.name} is not durable before the manifest: {events}"
    assert when[f"{temp}/dcp"] < manifest_at, "dcp/ (the data files' names) is durable before the manifest"
    assert when[f"{temp}/manifest.json"] < rename_at and when[temp] < rename_at, "manifest and its dir before the rename"
    assert when[str(final.parent)] > rename_at, "the parent is fsynced after the rename"


def test_snapshot_files_carry_no_zip_crc_yet_load_and_the_option_is_restored(tmp_path, monkeypatch):
    """Snapshots in the format before raw tensor files (``torch.save``): no CRC pass, still load."""
    monkeypatch.setattr(snapshot.LEGACY, "on", True)
    result = save(tmp_path / "ckpt", 1)
    assert torch.serialization.get_crc32_options() is True, "torch.save's CRC option is back once the save is done"
    infos = zipfile.ZipFile(result.path / snapshot.rank_tensors(0, legacy=True)).infolist()
    assert infos and all(info.CRC == 0 for info in infos), "our digests cover these bytes; no CRC pass"
    loaded = snapshot.load(result.path)
    torch.manual_seed(1)
    expected = {"model.w": torch.randn(1000), "model.b": torch.randn(3, 5), "rng.torch": torch.randn(7)}
    assert all(torch.equal({**loaded.shared_tensors, **loaded.rank_tensors}[k], t) for k, t in expected.items())


def test_overlapping_saves_restore_the_crc_option_once_the_last_ends():
    with zip_crc.skipped():
        with zip_crc.skipped():
            assert torch.serialization.get_crc32_options() is False
        assert torch.serialization.get_crc32_options() is False, "the other save is still persisting"
    assert torch.serialization.get_crc32_options() is True


def test_streaming_file_writes_every_byte_across_writeback_windows(tmp_path):
    pieces = [os.urandom(n) for n in (1000, 5000, 4096, 1, 9000, 300)]
    with StreamingFile(tmp_path / "data", window=4096) as stream:
        for piece in pieces:
            assert stream.write(piece) == len(piece)
        stream.flush()
        os.fsync(stream.fileno())
    assert (tmp_path / "data").read_bytes() == b"".join(pieces)


# --- ranks: the plan cache, and a world of one with a real process group ---------------------------

RANK_SCRIPT = r"""
import json, sys, tempfile
from pathlib import Path
import torch, torch.distributed as dist
from ckptrun.runtime.checkpoint import snapshot, zip_crc
from ckptrun.runtime.storage import store
from ckptrun.runtime.checkpoint.save_plan import OwnedKeys
from ckptrun.runtime.checkpoint.saver import Saver
from ckptrun.runtime.checkpoint.treecodec import split

rank, world, port = map(int, sys.argv[1:4])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
torch.manual_seed(0)
tensors = {"a": torch.randn(64, 64), "b": torch.randn(256), "c": torch.randn(32, 3), "e": torch.randn(100)}
owned, seen = OwnedKeys(), []
def plan():
    seen.append({"keys": sorted(owned(tensors)), "plans": owned.plans_made})
plan(); plan()                                     # the same layout twice: planned once
tensors["b"] = torch.randn(512); plan()            # a shape changed on every rank: planned again
if rank == 1:
    tensors["d"] = torch.randn(8)                  # a key only rank 1 has: every rank re-plans, none hangs
plan()
tensors["c"] = tensors["c"].double(); plan()       # a dtype changed
saved = None
if world == 1:                                     # a sync save through a real group of one
    ckpt = Path(sys.argv[4])
    lineage = store.ensure_lineage(ckpt, "w1")
    tree, shared = split(dict(tensors), "t")
    state = snapshot.State({"objects": {"t": tree}, "counters": {"step": 1}}, shared, {"rng": {}}, {"rng.torch": torch.randn(3)})
    info = snapshot.SnapshotInfo("w1", lineage.current, None, 1, 0, 0, "fp32", {}, "")
    results = []
    saver = Saver(ckpt, "sha256", asynchronous=False)
    saver.begin(state, info, lambda phase: None, results.append)
    loaded = snapshot.load(results[0].path)
    saved = {"ok": results[0].ok, "error": results[0].error, "plans": saver.owned.plans_made,
             "equal": all(torch.equal(loaded.shared_tensors[f"t.{k}"], t) for k, t in tensors.items())}
print(json.dumps({"rank": rank, "seen": seen, "saved": saved}))
dist.destroy_process_group()
"""


def run_ranks(world: int, tmp_path: Path) -> list[dict]:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(rank), str(world), str(port), str(tmp_path / "ckpt")],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(world)]
    out = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=90)
            assert proc.returncode == 0, stderr[-3000:]
            out.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return out


@pytest.mark.timeout(120)
def test_plan_is_reused_while_the_layout_is_unchanged_and_redone_on_every_rank_when_it_changes(tmp_path):
    ranks = run_ranks(2, tmp_path)
    for rank in ranks:
        assert [s["plans"] for s in rank["seen"]] == [1, 1, 2, 3, 4], rank
    for call in range(5):
        keys = [set(rank["seen"][call]["keys"]) for rank in ranks]
        assert not keys[0] & keys[1], f"call {call}: a tensor written by both ranks"
        expected = {"a", "b", "c", "e"} | ({"d"} if call >= 3 else set())
        assert keys[0] | keys[1] == expected, f"call {call}: every tensor written once"
    assert "d" in ranks[1]["seen"][3]["keys"], "only rank 1 holds d"


@pytest.mark.timeout(120)
def test_world_of_one_with_a_process_group_plans_nothing_and_saves(tmp_path):
    [rank] = run_ranks(1, tmp_path)
    assert [s["plans"] for s in rank["seen"]] == [0] * 5, "a world of one writes everything: no plan, no collective"
    assert rank["saved"] == {"ok": True, "error": None, "plans": 0, "equal": True}
