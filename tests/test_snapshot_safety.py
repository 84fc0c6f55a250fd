"""Snapshot safety in one process with real saves and real files: fsync covers every byte, hostile DCP
metadata is refused before anything is allocated, and retention checks without re-hashing.

A real in-process save (``Saver``, sync) writes each snapshot; the tests then watch or damage it.
"""

from __future__ import annotations

import json
import os
import pickle
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from ckptrun.runtime.checkpoint import raw_dcp, snapshot
from ckptrun.runtime import hashing, records
from ckptrun.runtime.storage import store
from ckptrun.runtime.checkpoint.dcp_io import UnsafeMetadataError, load_metadata
from ckptrun.runtime.hashing import hash_file
from ckptrun.runtime.checkpoint.policies import Retention
from ckptrun.runtime.checkpoint.retention import apply_retention
from ckptrun.runtime.checkpoint.verify import verify_snapshot
from snapshot_factory import plant_pickle, save_state

ODD = 10_001  # float32 elements: not a multiple of any buffer size, so a buffered tail is left to flush


def save(ckpt_dir: Path, step: int, legacy: bool = False) -> Path:
    """A real snapshot of a small state, written through the runtime's sync saver in this process (``legacy``:
    in the format before raw tensor files, ``torch.save`` items and a pickled ``.metadata``)."""
    torch.manual_seed(step)
    state = snapshot.State({"objects": {}, "counters": {"step": step}}, {"model.w": torch.randn(ODD), "model.b": torch.randn(3, 5)},
                           {"rng": {}}, {"rng.torch": torch.randn(ODD)})
    return save_state(ckpt_dir, state, step, "safety", legacy)


# --- item 5: fsync covers every byte ------------------------------------------------


def test_every_file_is_whole_on_disk_when_it_is_fsynced(tmp_path, monkeypatch):
    real_fsync = os.fsync
    at_fsync: dict[int, int] = {}  # inode -> size on disk when fsync ran

    def watching_fsync(fd: int) -> None:
        status = os.fstat(fd)
        if not os.path.isdir(f"/proc/self/fd/{fd}"):
            at_fsync[status.st_ino] = status.st_size
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", watching_fsync)
    path = save(tmp_path / "ckpt", 1)
    files = [p for p in path.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"__0_0.safetensors", "metadata.json", "rank-00000.safetensors", "manifest.json"}
    for file in files:
        status = file.stat()
        assert status.st_ino in at_fsync, f"{file.name} was never fsynced"
        assert at_fsync[status.st_ino] == status.st_size, (
            f"{file.name}: {at_fsync[status.st_ino]} bytes on disk at fsync, {status.st_size} in the end")


# --- item 4: hostile DCP metadata -----------------------------------------------------


def rewrite_metadata(snapshot_dir: Path, change) -> None:
    """Craft the DCP metadata from real DCP objects (``metadata.json``, or a legacy snapshot's pickled
    ``.metadata``), then update the manifest so its digest matches."""
    metadata = load_metadata(snapshot_dir / "dcp")
    change(metadata)
    raw = (snapshot_dir / "dcp" / "metadata.json").exists()
    target = snapshot_dir / "dcp" / ("metadata.json" if raw else ".metadata")
    target.write_bytes(raw_dcp.encode_metadata(metadata) if raw else pickle.dumps(metadata))
    size, digest = hash_file(target, "sha256")
    document = json.loads((snapshot_dir / "manifest.json").read_text())
    next(f for f in document["files"] if f["path"] == f"dcp/{target.name}").update(size=size, digest=digest)
    (snapshot_dir / "manifest.json").write_text(json.dumps(document))


def storage(metadata, fqn: str):
    return next(index for index in metadata.storage_data if index.fqn == fqn)


def set_storage(metadata, fqn: str, **fields) -> None:
    index = storage(metadata, fqn)
    metadata.storage_data[index] = replace(metadata.storage_data[index], **fields)


def huge_tensor(metadata) -> None:
    """2^60 float32 elements declared for ``model.b``, read from outside the snapshot."""
    item = metadata.state_dict_metadata["model.b"]
    item.size = torch.Size([2**60])
    item.chunks[0].offsets, item.chunks[0].sizes = torch.Size([0]), torch.Size([2**60])
    set_storage(metadata, "model.b", relative_path="../../../etc/passwd")


HOSTILE = {
    "huge-and-outside": (huge_tensor, "../../../etc/passwd"),
    "outside": (lambda m: set_storage(m, "model.b", relative_path="../../../etc/passwd"), "not a plain file name"),
    "absolute": (lambda m: set_storage(m, "model.b", relative_path="/etc/passwd"), "not a plain file name"),
    "unlisted": (lambda m: set_storage(m, "model.b", relative_path="__7_0.safetensors"), "not listed in the manifest"),
    "metadata-itself": (lambda m: set_storage(m, "model.b", relative_path=".metadata"), "not listed in the manifest"),
    "chunk-past-end": (lambda m: set_storage(m, "model.b", length=10**9), "outside its"),
    "negative-offset": (lambda m: set_storage(m, "model.b", offset=-8), "outside its"),
    "total-mismatch": (lambda m: set_storage(m, "model.b", length=1000), "declares 42577 bytes"),
    "huge-in-place": (lambda m: setattr(m.state_dict_metadata["model.w"], "size", torch.Size([2**60])), "model.w"),
    "transform": (lambda m: set_storage(m, "model.b", transform_descriptors=["zstd"]), "transform"),
}


RAW_SAYS = {  # the raw format words a few of them otherwise: each file is its header and its chunks, to its end
    "total-mismatch": "outside its",
    "chunk-past-end": "outside its",
}


# metadata.json has no field for transforms: only a legacy (pickled) snapshot can declare one
CASES = [(kind, legacy) for kind in sorted(HOSTILE) for legacy in (False, True) if legacy or kind != "transform"]


@pytest.mark.parametrize(("kind", "legacy"), CASES, ids=[f"{k}-{'legacy' if l else 'raw'}" for k, l in CASES])
def test_hostile_dcp_metadata_is_refused_before_any_allocation(tmp_path, monkeypatch, kind, legacy):
    change, said = HOSTILE[kind]
    said = said if legacy else RAW_SAYS.get(kind, said)
    path = save(tmp_path / "ckpt", 1, legacy)
    (path / "state.json").write_text(json.dumps({"objects": {"model": {"w": {"__tensor__": "model.w"},
                                                                      "b": {"__tensor__": "model.b"}}}}))
    entry = hash_file(path / "state.json", "sha256")
    document = json.loads((path / "manifest.json").read_text())
    next(f for f in document["files"] if f["path"] == "state.json").update(size=entry[0], digest=entry[1])
    (path / "manifest.json").write_text(json.dumps(document))
    assert snapshot.load(path).shared_tensors["model.w"].shape == (ODD,), "the untouched snapshot loads"
    rewrite_metadata(path, change)
    allocated: list[str] = []
    real_allocate = snapshot.allocate_from_metadata
    monkeypatch.setattr(snapshot, "allocate_from_metadata", lambda m, keys: allocated.append("yes") or real_allocate(m, keys))
    with pytest.raises(snapshot.LoadError) as caught:
        snapshot.load(path)
    assert said in str(caught.value) and "UnsafeMetadataError" in str(caught.value)
    assert not allocated, "tensors were allocated from metadata that had not been checked"


# --- item 9: retention checks without re-hashing, unless paranoid ------------------------


def count_hashing(monkeypatch) -> list[str]:
    """Every hasher opened in this process (a re-hash of a file opens one)."""
    opened: list[str] = []
    real = hashing.new_hasher
    monkeypatch.setattr(hashing, "new_hasher", lambda algorithm, **how: opened.append(algorithm) or real(algorithm, **how))
    return opened


def three_snapshots(tmp_path: Path) -> tuple[Path, Path]:
    ckpt, run_dir = tmp_path / "ckpt", tmp_path / "run"
    run_dir.mkdir()
    for step in (1, 2, 3):
        save(ckpt, step)
    return ckpt, run_dir


def steps(ckpt: Path) -> list[int]:
    return sorted(entry.step for entry, _ in store.current_lineage(ckpt))


def test_default_retention_checks_manifest_and_sizes_without_rehashing(tmp_path, monkeypatch):
    ckpt, run_dir = three_snapshots(tmp_path)
    opened = count_hashing(monkeypatch)
    assert apply_retention(ckpt, Retention(keep_last=2), run_dir) == [1]
    assert opened == [], "retention re-hashed the newest snapshot"
    assert steps(ckpt) == [2, 3]
    save(ckpt, 4)
    rank_file = ckpt / "step-000000004" / "rank-00000.safetensors"
    rank_file.write_bytes(rank_file.read_bytes()[:100])  # truncated: the size check sees it
    assert apply_retention(ckpt, Retention(keep_last=2), run_dir) == []
    assert steps(ckpt) == [2, 3, 4]
    assert "does not verify" in records.read_events(run_dir, "retention_skipped")[-1]["reason"]


def test_paranoid_retention_rereads_the_newest_snapshot_and_a_flipped_byte_blocks_deletion(tmp_path, monkeypatch):
    ckpt, run_dir = three_snapshots(tmp_path)
    data = ckpt / "step-000000003" / "dcp" / "__0_0.safetensors"
    content = bytearray(data.read_bytes())
    content[len(content) // 2] ^= 0xFF  # same size: only a re-read finds it
    data.write_bytes(bytes(content))
    opened = count_hashing(monkeypatch)
    assert apply_retention(ckpt, Retention(keep_last=2), run_dir, paranoid=True) == []
    assert opened, "paranoid retention did not re-read the newest snapshot"
    assert steps(ckpt) == [1, 2, 3], "nothing is deleted while the newest snapshot does not verify"
    assert "sha256" in records.read_events(run_dir, "retention_skipped")[-1]["reason"]
    assert apply_retention(ckpt, Retention(keep_last=2), run_dir) == [1], "the default check trusts the write-time digests"


def _planned(chunks: list[tuple[int, int]]):
    """DCP's own load planner over a stored 4-element tensor ``w`` of which the snapshot holds ``chunks``."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties

    stored = [ChunkStorageMetadata(offsets=torch.Size([o]), sizes=torch.Size([n])) for o, n in chunks]
    metadata = Metadata(state_dict_metadata={"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32),
                                                                         torch.Size([4]), stored)})
    storage = {MetadataIndex("w", torch.Size([o])): _StorageInfo("__0_0.safetensors", 0, 8) for o, _ in chunks}
    planner = DefaultLoadPlanner()
    planner.set_up_planner({"w": torch.empty(4)}, metadata, is_coordinator=True)
    return planner.create_local_plan(), planner, storage


def test_a_load_that_would_leave_part_of_a_tensor_unread_is_refused() -> None:
    """A snapshot of some ranks only (a node's memory copy) holds some chunks of a tensor: a rank whose part
    is not among them must fail, never keep the bytes it allocated."""
    from ckptrun.runtime.checkpoint.dcp_io import _check_coverage

    _check_coverage(*_planned([(0, 2), (2, 2)]))  # both halves stored: every element is read
    with pytest.raises(UnsafeMetadataError, match="holds 2 of the 4 elements"):
        _check_coverage(*_planned([(0, 2)]))


@pytest.mark.parametrize("relative", ["dcp/.metadata", "rank-00000.pt"])
def test_a_malicious_pickle_in_a_legacy_snapshot_is_refused_and_never_runs(tmp_path, relative):
    """The format before raw tensor files still unpickles two files when it loads (``.metadata`` through a
    restricted unpickler, ``rank-*.pt`` with ``weights_only``): an exploit planted there with a matching digest
    is refused, and its code never runs. (A new snapshot's files are never unpickled at all: test_raw_format.)"""
    path = save(tmp_path / "ckpt", 1, legacy=True)
    marker = tmp_path / "marker"
    plant_pickle(path, relative, marker)
    assert verify_snapshot(path).ok, "digests match: integrity is not trust"
    with pytest.raises(snapshot.LoadError):
        snapshot.load(path)
    assert not marker.exists(), "the malicious pickle ran"
