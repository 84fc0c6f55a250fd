"""Chunk digests (issue #13 items 2-3): digests of every stored DCP item, cut at each item and every
``SUB_CHUNK`` bytes inside one, taken as it is written, checked as it is loaded.

Single-process tests save real snapshots through the sync saver and damage them; the end-to-end test
flips a byte in an item only rank 1 of a 2-rank FSDP2 job reads and resumes under plain torchrun.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from snapshot_factory import flip_byte, make_snapshot, manifest_dict, write_manifest_dict
from workers import run_job, shared_tensors

from ckptrun.runtime.checkpoint import snapshot
from ckptrun.runtime.storage import store
from ckptrun.runtime.checkpoint.dcp_io import load_metadata
from ckptrun.runtime.hashing import SUB_CHUNK, HashingWriter, chunks_digest, entry_hasher, hash_file
from ckptrun.runtime.manifest import is_data_file, read_manifest
from ckptrun.runtime.records import losses_by_attempt, read_events
from ckptrun.runtime.checkpoint.saver import Saver
from ckptrun.runtime.checkpoint.verify import verify_snapshot

FSDP_JOB = Path(__file__).parent / "fixtures" / "fsdp_job.py"
TENSORS = {"model.w": (300, 41), "model.b": (7,), "optimizer.m": (70_001,)}  # 70001 floats: hashed on the helper thread
LARGE = {"model.big": (5 * SUB_CHUNK // 4 // 2 + 333,), "model.b": (7,)}  # 2.5 sub-chunks and a bit: several chunks


def save(ckpt_dir: Path, step: int = 1, algorithm: str = "sha256",
         shapes: dict[str, tuple[int, ...]] = TENSORS) -> tuple[Path, dict[str, torch.Tensor]]:
    """A real one-rank snapshot of a few tensors, written by the sync saver in this process."""
    lineage = store.ensure_lineage(ckpt_dir, "chunks")
    generator = torch.Generator().manual_seed(step)
    tensors = {key: torch.randn(shape, generator=generator) for key, shape in shapes.items()}
    tree = {"objects": {"model": {key: {"__tensor__": key} for key in tensors}}, "counters": {"step": step}}
    state = snapshot.State(tree, tensors, {"rng": {}}, {"rng.torch": torch.randn(5, generator=generator)})
    info = snapshot.SnapshotInfo("chunks", lineage.current, None, step, 0, 0, "fp32", {}, "")
    results: list[snapshot.SaveResult] = []
    Saver(ckpt_dir, algorithm, asynchronous=False).begin(state, info, lambda phase: None, results.append)
    assert results[0].ok, results[0].error
    return results[0].path, tensors


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    return save(tmp_path / "ckpt")


def item_ranges(snapshot_dir: Path) -> dict[str, tuple[str, int, int]]:
    """Where DCP stored each tensor: (file, offset, length) by key."""
    metadata = load_metadata(snapshot_dir / "dcp")
    return {index.fqn: (info.relative_path, info.offset, info.length) for index, info in metadata.storage_data.items()}


def chunks_of_items(snapshot_dir: Path) -> dict[str, list[tuple[int, int]]]:
    """Each tensor's chunks (offset, length) as the manifest lists them; asserts they tile its byte range."""
    entries = {e.path: e for e in read_manifest(snapshot_dir).files}
    found = {}
    for key, (name, offset, length) in item_ranges(snapshot_dir).items():
        inside = [(c.offset, c.length) for c in entries[f"dcp/{name}"].chunks
                  if offset <= c.offset < offset + length]
        assert inside[0][0] == offset and sum(n for _, n in inside) == length, f"{key}'s chunks do not tile it"
        assert all(o + n == o2 for (o, n), (o2, _) in zip(inside, inside[1:]))
        found[key] = inside
    return found


def header_length(snapshot_dir: Path, relative: str) -> int:
    """Where a raw data file's first tensor starts: the bytes of its header (length and JSON)."""
    return 8 + int.from_bytes((snapshot_dir / relative).read_bytes()[:8], "little")


def item_only(path: Path) -> None:
    """Rewrite a snapshot's manifest as written before sub-chunks: schema 3, one chunk per DCP item."""
    document = manifest_dict(path)
    for entry in document["files"]:
        if entry.get("chunks"):
            data = (path / entry["path"]).read_bytes()
            items = sorted((offset, length) for name, offset, length in item_ranges(path).values()
                           if f"dcp/{name}" == entry["path"])
            items.insert(0, (0, header_length(path, entry["path"])))
            entry["chunks"] = [{"offset": o, "length": n, "digest": hashlib.sha256(data[o:o + n]).hexdigest()}
                               for o, n in items]
            entry["digest"] = chunks_digest("sha256", [(c["offset"], c["length"], c["digest"]) for c in entry["chunks"]])
    write_manifest_dict(path, document)


# --- written: chunks at every item and every SUB_CHUNK bytes inside one, file digest over the chunk list


def test_each_data_file_is_chunked_by_item_and_its_digest_is_the_chunk_lists(saved):
    path, _ = saved
    manifest = read_manifest(path)
    assert manifest.schema_version == 3 and manifest.verified_as_loaded
    data_files = [e for e in manifest.files if is_data_file(e.path)]
    assert data_files and all(e.chunks is None for e in manifest.files if e not in data_files), "small files stay whole"
    stored = {(f"dcp/{name}", offset, length) for name, offset, length in item_ranges(path).values()}
    stored |= {(e.path, 0, header_length(path, e.path)) for e in data_files}  # each file's header: a chunk too
    assert {(e.path, c.offset, c.length) for e in data_files for c in e.chunks} == stored, "small items: one chunk each"
    for entry in data_files:
        data = (path / entry.path).read_bytes()
        assert [c.offset for c in entry.chunks][0] == 0 and sum(c.length for c in entry.chunks) == len(data)
        for chunk in entry.chunks:
            assert hashlib.sha256(data[chunk.offset:chunk.offset + chunk.length]).hexdigest() == chunk.digest
        assert entry.digest == chunks_digest("sha256", [(c.offset, c.length, c.digest) for c in entry.chunks])
        hasher = entry_hasher(entry)  # what `verify`, uploads and downloads compute, fed in odd pieces
        for start in range(0, len(data), 9_999):
            hasher.update(data[start:start + 9_999])
        assert hasher.hexdigest() == entry.digest and hasher.bad_chunks() == []
    assert verify_snapshot(path).ok


def test_a_large_item_is_cut_into_sub_chunks_that_tile_it_and_each_is_checked_as_loaded(tmp_path):
    """A large item's bytes hash on several threads (written and read): its chunks tile it, each at most
    SUB_CHUNK; one byte flipped in the middle of a sub-chunk fails the load naming the tensor and the chunk."""
    path, tensors = save(tmp_path / "ckpt", shapes=LARGE)
    chunks = chunks_of_items(path)
    assert len(chunks["model.big"]) == 3 and all(n <= SUB_CHUNK for _, n in chunks["model.big"])
    assert len(chunks["model.b"]) == 1
    assert all(torch.equal(snapshot.load(path).shared_tensors[k], tensors[k]) for k in tensors)
    offset, length = chunks["model.big"][1]
    name = item_ranges(path)["model.big"][0]
    flip_byte(path / "dcp" / name, offset + length // 2)
    with pytest.raises(snapshot.LoadError) as caught:
        snapshot.load(path)
    said = str(caught.value)
    assert f"rank 0: DigestMismatch: dcp/{name} bytes {offset}..{offset + length} (tensor 'model.big')" in said
    assert f"of bytes {offset}..{offset + length}" in " ".join(verify_snapshot(path).problems)


def test_an_item_only_schema_3_manifest_still_verifies_and_loads_checking_each_item(tmp_path):
    """Written before sub-chunks: one chunk per item, however large. Still verified as loaded, item by item."""
    path, tensors = save(tmp_path / "ckpt", shapes=LARGE)
    item_only(path)
    assert read_manifest(path).verified_as_loaded and verify_snapshot(path).ok
    assert all(len(c) == 1 for c in chunks_of_items(path).values())
    assert all(torch.equal(snapshot.load(path).shared_tensors[k], tensors[k]) for k in tensors)
    name, offset, length = item_ranges(path)["model.big"]
    flip_byte(path / "dcp" / name, offset + length // 2)
    assert verify_snapshot(path, at_load=True).deferred
    with pytest.raises(snapshot.LoadError, match=rf"dcp/{name} bytes {offset}\.\.{offset + length} \(tensor 'model.big'\)"):
        snapshot.load(path)


def test_hashing_writer_digest_is_the_same_with_the_helper_thread(tmp_path):
    big, small = bytes(range(256)) * 8192, b"tail"  # 2 MiB: hashed beside the write syscall
    with open(tmp_path / "plain", "wb") as raw:
        plain = HashingWriter(raw, "sha256")
        plain.write(big), plain.write(small)
    assert plain.hexdigest() == hashlib.sha256(big + small).hexdigest() and plain.size == len(big) + len(small)
    with open(tmp_path / "chunked", "wb") as raw:
        chunked = HashingWriter(raw, "sha256", chunked=True)
        chunked.tell(), chunked.write(big), chunked.tell(), chunked.write(small)
    assert chunked.hexdigest() == chunks_digest("sha256", [(0, len(big), hashlib.sha256(big).hexdigest()),
                                                           (len(big), 4, hashlib.sha256(small).hexdigest())])


@pytest.mark.parametrize("writes", [[5 * SUB_CHUNK + 99], [100, SUB_CHUNK - 100, 7, 3 * SUB_CHUNK, SUB_CHUNK + 92]])
def test_hashing_writer_cuts_a_chunk_every_sub_chunk_bytes_inside_an_item(tmp_path, writes):
    """However the item's bytes arrive (one large write hashed on helpers, or small inline ones), chunks end at
    every SUB_CHUNK bytes from the item's start and at each tell(), and each digest is of exactly its bytes."""
    data = bytes(range(256)) * (sum(writes) // 256 + 1)
    with open(tmp_path / "chunked", "wb") as raw:
        stream = HashingWriter(raw, "sha256", chunked=True)
        stream.write(b"head"), stream.tell()
        start = 0
        for size in writes:
            stream.write(data[start:start + size])
            start += size
        stream.tell(), stream.write(b"tail")
        digest = stream.hexdigest()
    written = b"head" + data[:start] + b"tail"
    lengths = [4] + [SUB_CHUNK] * 5 + [99, 4]
    assert [n for _, n, _ in stream.chunks] == lengths and stream.size == len(written) == sum(lengths)
    assert all(hashlib.sha256(written[o:o + n]).hexdigest() == d for o, n, d in stream.chunks)
    assert digest == chunks_digest("sha256", stream.chunks)
    assert written == (tmp_path / "chunked").read_bytes()


def test_hash_helpers_are_kept_across_files_and_a_thread_that_asks_for_one_gets_one(tmp_path):
    """A save starts no threads (its helpers live as long as the process), and a background persist hashes on
    one helper (it shares the cores with training): same chunks, same digests either way."""
    from ckptrun.runtime import hashing

    data = bytes(range(256)) * ((3 * SUB_CHUNK) // 256)
    made = []
    for count in (1, None, 1):
        with open(tmp_path / f"f{len(made)}", "wb") as raw, (hashing.helpers(count) if count else contextlib.nullcontext()):
            with contextlib.closing(HashingWriter(raw, "sha256", chunked=True)) as stream:
                stream.write(data)
                pool = hashing.helper_pool(count or hashing.HASH_HELPERS)
                made.append((pool, set(pool._threads), stream.chunks, stream.hexdigest()))
    (one, one_threads, *one_digests), (two, _, *two_digests), (again, again_threads, *_) = made
    assert one._max_workers == 1 and two._max_workers == hashing.HASH_HELPERS
    assert again is one and again_threads == one_threads and all(t.is_alive() for t in one_threads), \
        "the second file hashed on the first one's helper, which outlived its file"
    assert one_digests == two_digests and len(one_digests[0]) == 3


# --- loaded: every byte checked as it is read, once -------------------------------------------------


def test_load_checks_each_item_as_it_reads_it(saved):
    path, tensors = saved
    assert verify_snapshot(path, at_load=True).deferred, "the pre-load check leaves chunked digests to the load"
    live = torch.zeros(TENSORS["model.w"])
    loaded = snapshot.load(path, live={"model.w": live})
    assert loaded.shared_tensors["model.w"] is live and torch.equal(live, tensors["model.w"]), "loaded in place"
    assert all(torch.equal(loaded.shared_tensors[k], tensors[k]) for k in tensors)
    name, offset, length = item_ranges(path)["model.b"]
    flip_byte(path / "dcp" / name, offset + length // 2)
    report = verify_snapshot(path, at_load=True)
    assert report.ok and report.deferred and "digests verified as loaded" in report.checked
    with pytest.raises(snapshot.LoadError) as caught:
        snapshot.load(path)
    said = str(caught.value)
    assert f"rank 0: DigestMismatch: dcp/{name} bytes {offset}..{offset + length} (tensor 'model.b')" in said
    problems = " ".join(verify_snapshot(path).problems)  # `ckptrun verify` names the chunk too
    assert f"dcp/{name}: sha256" in problems and f"of bytes {offset}..{offset + length}" in problems


@pytest.mark.parametrize("relative", ["state.json", "rank-00000.safetensors", "dcp/metadata.json"])
def test_load_checks_the_small_files_it_reads(saved, relative):
    path, _ = saved
    flip_byte(path / relative, 2)
    with pytest.raises(snapshot.LoadError, match=f"rank 0: DigestMismatch: {relative}: sha256"):
        snapshot.load(path)


def test_a_schema_2_manifest_still_verifies_whole_and_loads(saved):
    """Written before chunk digests: no chunks, whole-file digests; hashed whole before the load, not during it."""
    path, tensors = saved
    document = manifest_dict(path)
    document["schema_version"] = 2
    for entry in document["files"]:
        if entry.pop("chunks", None) is not None:
            entry["digest"] = hash_file(path / entry["path"], "sha256")[1]
    write_manifest_dict(path, document)
    manifest = read_manifest(path)
    assert not manifest.verified_as_loaded
    report = verify_snapshot(path, at_load=True)
    assert report.ok and not report.deferred, "older snapshots are hashed whole before a load"
    assert all(torch.equal(snapshot.load(path).shared_tensors[k], tensors[k]) for k in tensors)
    flip_byte(path / "dcp" / "__0_0.safetensors")
    assert not verify_snapshot(path, at_load=True).ok


def test_factory_snapshots_without_data_files_are_hashed_whole(tmp_path):
    path = make_snapshot(tmp_path / "ckpt", 10)
    assert not read_manifest(path).verified_as_loaded and not verify_snapshot(path, at_load=True).deferred


def test_manifest_refuses_chunks_that_do_not_tile_the_file(saved):
    path, _ = saved
    document = manifest_dict(path)
    entry = next(e for e in document["files"] if e.get("chunks"))
    entry["chunks"][-1]["length"] += 1
    write_manifest_dict(path, document)
    assert verify_snapshot(path).status == "corrupt" and "chunks cover" in verify_snapshot(path).problems[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("relative", ["dcp/__0_0.safetensors", "rank-00000.json"])
def test_ckptrun_verify_catches_a_flipped_byte(saved, relative):
    import subprocess
    import sys

    path, _ = saved
    assert subprocess.run([sys.executable, "-m", "ckptrun.cli.main", "verify", str(path.parent)],
                          capture_output=True).returncode == 0
    flip_byte(path / relative)
    result = subprocess.run([sys.executable, "-m", "ckptrun.cli.main", "verify", str(path.parent), "--json"],
                            capture_output=True, text=True)
    assert result.returncode == 1
    assert f"{relative}: sha256" in json.dumps(json.loads(result.stdout)["snapshots"][0]["problems"])


# --- end to end: rank 1's chunk, caught by rank 1, agreed by both, fallback, exact ---------------------


@pytest.mark.e2e
@pytest.mark.timeout(420)
def test_a_corrupt_chunk_only_rank_1_reads_fails_the_load_on_both_ranks_and_falls_back_exactly(tmp_path):
    """Uninterrupted FSDP2 run to step 12 (snapshots 4, 8, 12) is the reference. Step 12 is set aside, one byte of
    an item in step 8 that only rank 1 reads (its shard) is flipped; the resumed run refuses step 8 on both ranks,
    restores step 4, and ends with the reference's losses and tensors."""
    run_dir = tmp_path / "run"
    first = run_job(run_dir, nproc=2, script=FSDP_JOB, args=("--steps", "12"), save_every_steps=4, timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt = run_dir / "checkpoints"
    reference = shutil.move(ckpt / "step-000000012", tmp_path / "reference-step-12")
    step8 = ckpt / "step-000000008"
    metadata = load_metadata(step8 / "dcp")
    index, info = next((i, s) for i, s in metadata.storage_data.items()
                       if s.relative_path == "__1_0.safetensors" and i.fqn.endswith("exp_avg") and any(i.offset))
    flip_byte(step8 / "dcp" / info.relative_path, info.offset + info.length // 2)
    assert verify_snapshot(step8, at_load=True).deferred, "sizes unchanged: only the load can catch it"

    resumed = run_job(run_dir, nproc=2, script=FSDP_JOB, args=("--steps", "12"), save_every_steps=4, attempt=2,
                      timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    failed = read_events(run_dir, "restore_failed")
    assert [Path(e["snapshot"]).name for e in failed] == ["step-000000008"]
    reason = failed[0]["reason"]
    assert "rank 1: DigestMismatch" in reason and "rank 0" not in reason, reason
    assert f"dcp/__1_0.safetensors bytes {info.offset}..{info.offset + info.length} (tensor {index.fqn!r})" in reason
    assert [e["step"] for e in read_events(run_dir, "restored") if e["attempt"] == 2] == [4], "both ranks fell back"
    expected = losses_by_attempt(run_dir)[1]
    assert losses_by_attempt(run_dir)[2] == {step: expected[step] for step in range(5, 13)}
    ref, got = shared_tensors(Path(reference)), shared_tensors(ckpt / "step-000000012")
    assert ref.keys() == got.keys() and [k for k in ref if not torch.equal(ref[k], got[k])] == []


def test_memory_file_serves_torch_load_without_copying_the_buffer():
    from ckptrun.runtime.checkpoint.verified_read import MemoryFile

    buffer = io.BytesIO()
    torch.save(torch.arange(10), buffer)
    assert torch.equal(torch.load(MemoryFile(memoryview(buffer.getvalue())), weights_only=True), torch.arange(10))
