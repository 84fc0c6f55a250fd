"""Async snapshots: the step waits only for staging, and nothing else changes — atomic, exact, verified.

The atomicity and exactness tests elsewhere run with async saves (the default)
and kill ranks during the background phases; these cover what is specific to
the background writer: staging buffers reused, stop and finish waiting for the
in-flight save, sync mode still working, blake3 manifests.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading

import pytest

from ckptrun.runtime.storage import store
from ckptrun.runtime.manifest import read_manifest
from ckptrun.runtime.records import read_events, read_metrics
from ckptrun.runtime.checkpoint.verify import IN_PROGRESS, verify_dir
from workers import run_job

FAST = ("--num-workers", "0")


@pytest.mark.timeout(120)
def test_staging_buffers_are_reused_across_saves(tmp_path):
    run_dir = tmp_path / "run"
    result = run_job(run_dir, args=("--steps", "10", "--hidden", "2048", *FAST), save_every_steps=1, keep_last=1)
    assert result.returncode == 0, result.stderr[-2000:]
    saved = {e["step"]: e for e in read_events(run_dir, "snapshot_saved")}
    snapshot_bytes = saved[2]["bytes"]
    def level(steps):  # the allocator's arenas make single samples jitter by one tensor's size
        return statistics.median(saved[s]["rss_after_stage_bytes"] for s in steps)

    growth = level((8, 9, 10)) - level((2, 3, 4))
    # a leak of staging buffers would add a whole snapshot per save (6 between the two medians); the allocator's
    # arenas and the writer thread's serialisation buffers move RSS by up to ~0.6 snapshot on a loaded fresh clone
    # (80 MiB of 130 seen in CI): the bound catches a leak of a quarter of the buffers per save, not that noise.
    # The exact check of reuse is the allocation count below.
    assert growth <= 1.5 * snapshot_bytes, (
        f"RSS grew by {growth / 2**20:.1f} MiB over 6 saves of {snapshot_bytes / 2**20:.1f} MiB")
    assert all(e["asynchronous"] for e in saved.values())
    assert saved[1]["staging_allocated_bytes"] > 0
    assert [saved[s]["staging_allocated_bytes"] for s in range(2, 11)] == [0] * 9, "buffers allocated once"
    assert any(m["saving"] for m in read_metrics(run_dir)), "steps overlapping a background save are marked"


@pytest.mark.timeout(120)
def test_finish_waits_for_the_in_flight_save(tmp_path):
    run_dir = tmp_path / "run"
    assert run_job(run_dir, args=("--steps", "7", *FAST), save_every_steps=3).returncode == 0
    events = [e["event"] for e in read_events(run_dir)]
    assert events.index("completed") > max(i for i, e in enumerate(events) if e == "snapshot_saved")
    ckpt = run_dir / "checkpoints"
    assert [e.step for e in store.list_entries(ckpt)] == [3, 6, 7]
    assert all(r.ok for r in verify_dir(ckpt))


@pytest.mark.timeout(120)
def test_stop_request_saves_waits_and_exits_3(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "stop").touch()  # the supervisor's stop channel, seen at the first step boundary
    result = run_job(run_dir, args=("--steps", "50", *FAST), save_every_steps=1)
    assert result.returncode == 3, result.stderr[-2000:]
    [stopped] = read_events(run_dir, "stopped")
    names = [e["event"] for e in read_events(run_dir)]
    assert names.index("stopped") > names.index("snapshot_saved")
    assert [e.step for e in store.list_entries(run_dir / "checkpoints")] == [stopped["step"]]
    assert all(r.ok for r in verify_dir(run_dir / "checkpoints"))


@pytest.mark.timeout(120)
def test_sync_saves_still_work(tmp_path):
    run_dir = tmp_path / "run"
    assert run_job(run_dir, args=("--steps", "10", *FAST), save_every_steps=5, async_save=False).returncode == 0
    saved = read_events(run_dir, "snapshot_saved")
    assert [e["step"] for e in saved] == [5, 10] and not any(e["asynchronous"] for e in saved)
    assert not any(m["saving"] for m in read_metrics(run_dir))


@pytest.mark.timeout(120)
def test_blake3_manifests_verify_and_catch_corruption(tmp_path):
    pytest.importorskip("blake3")
    run_dir = tmp_path / "run"
    assert run_job(run_dir, args=("--steps", "5", *FAST), save_every_steps=5, hash_algorithm="blake3").returncode == 0
    snapshot = run_dir / "checkpoints" / "step-000000005"
    assert {f.algorithm for f in read_manifest(snapshot).files} == {"blake3"}
    verify = [sys.executable, "-m", "ckptrun.cli.main", "verify", str(snapshot), "--json"]
    assert subprocess.run(verify, capture_output=True).returncode == 0
    target = snapshot / "dcp" / "__0_0.safetensors"
    data = bytearray(target.read_bytes())
    data[-10] ^= 1
    target.write_bytes(bytes(data))
    result = subprocess.run(verify, capture_output=True, text=True)
    assert result.returncode == 1
    assert "dcp/__0_0.safetensors: blake3" in json.dumps(json.loads(result.stdout))


# --- the paced background writer (runtime.pacing) ------------------------------------------------

def test_pacer_pauses_only_the_paced_thread_after_each_chunk():
    from ckptrun.runtime.checkpoint import pacing

    with pacing.paced(0.5, chunk=1000) as pacer:
        pacing.wrote(600)
        assert pacer.paused_s == 0.0 and pacer.pending == 600, "no pause before a whole chunk"
        other = threading.Thread(target=pacing.wrote, args=(10**9,))  # an unpaced thread: a no-op there
        other.start()
        other.join()
        assert pacer.pending == 600
        pacing.wrote(600)
        assert pacer.paused_s > 0.0 and pacer.pending == 0, "a pause after the chunk, then a new chunk"
    with pacing.paced(1.0, chunk=1) as unpaced:
        pacing.wrote(10**6)
    assert unpaced.paused_s == 0.0, "duty 1.0 never pauses"
    pacing.wrote(10**9)  # outside the block nothing is paced
    with pytest.raises(ValueError, match="duty 0 must be in"):
        pacing.Pacer(0)


PACED_SAVE = r"""
import json, os, signal, sys, time
from pathlib import Path
import torch, torch.distributed as dist
from ckptrun.runtime.checkpoint import pacing, snapshot
from ckptrun.runtime.storage import store
from ckptrun.runtime.checkpoint.saver import Saver
from ckptrun.runtime.checkpoint.treecodec import split

ckpt, rendezvous, kill = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "kill"
dist.init_process_group("gloo", store=dist.FileStore(rendezvous, 1), rank=0, world_size=1)  # no port to race for
pacing.CHUNK = 64 << 10  # many pauses in a few MiB
torch.manual_seed(0)
tensors = {f"w{i}": torch.randn(256, 1024) for i in range(8)}  # 8 MiB
lineage = store.ensure_lineage(ckpt, "paced")
saver = Saver(ckpt, "sha256", asynchronous=True, nice=0, duty=0.5 if not kill else 0.001)
results = []

def save(step):
    tree, shared = split(dict(tensors), "t")
    state = snapshot.State({"objects": {"t": tree}, "counters": {"step": step}}, shared, {"rng": {}}, {"rng.torch": torch.randn(3)})
    info = snapshot.SnapshotInfo("paced", lineage.current, None, step, 0, 0, "fp32", {}, "")
    saver.begin(state, info, lambda phase: None, results.append)

save(1)
saver.collect(wait=True)
if kill:  # a second save, SIGKILLed once its data file is partly written
    save(2)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not results[1:]:
        data = [p for e in store.list_entries(ckpt) if e.kind == "temp" for p in e.path.rglob("*.safetensors")]
        if data and 0 < data[0].stat().st_size:
            print(json.dumps({"killed_at": data[0].stat().st_size}), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.002)
    print(json.dumps({"missed": True}))
    sys.exit(1)
loaded = snapshot.load(results[0].path)
print(json.dumps({"ok": results[0].ok, "error": results[0].error, "paused_s": saver.paused_s,
                  "equal": all(torch.equal(loaded.shared_tensors[f"t.{k}"], t) for k, t in tensors.items())}))
"""


def _paced_save(tmp_path, mode: str) -> subprocess.CompletedProcess:
    """One process, world size 1, its group's store a file: a free port picked here could be taken by another
    test's process before this one binds it (EADDRINUSE, seen once in a full run)."""
    return subprocess.run([sys.executable, "-c", PACED_SAVE, str(tmp_path / "ckpt"), str(tmp_path / "rendezvous"), mode],
                          capture_output=True, text=True, timeout=100)


@pytest.mark.timeout(120)
def test_paced_background_save_writes_every_byte_and_publishes_once(tmp_path):
    result = _paced_save(tmp_path, "save")
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["ok"] and out["error"] is None and out["equal"], out
    assert out["paused_s"] > 0, "the writer paused between chunks"
    entries = store.list_entries(tmp_path / "ckpt")
    assert [(e.step, e.kind) for e in entries] == [(1, "published")], "published once, no temp dir left"
    assert all(r.ok for r in verify_dir(tmp_path / "ckpt"))


@pytest.mark.timeout(120)
def test_kill_during_a_paced_persist_never_publishes_it(tmp_path):
    result = _paced_save(tmp_path, "kill")
    assert result.returncode == -9, (result.stdout[-500:], result.stderr[-3000:])
    assert "killed_at" in result.stdout
    entries = store.list_entries(tmp_path / "ckpt")
    assert [e.step for e in entries if e.kind == "published"] == [1], "the killed save is not published"
    assert [e.step for e in entries if e.kind == "temp"] == [2], "it is left as a temp dir, never read"
    reports = {r.step: r for r in verify_dir(tmp_path / "ckpt")}
    assert reports[1].ok and reports[2].status == IN_PROGRESS, reports
