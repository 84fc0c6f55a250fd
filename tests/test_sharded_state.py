"""One state path for every parallelism: FSDP2 shards resume bitwise, each rank stages and writes only
what it owns, tied weights are stored once, the manifest records writer ranks and global shapes.

Real torchrun, 2 CPU ranks over gloo (plain torchrun, no supervisor: the runtime picks the snapshot).
"""

from __future__ import annotations

import json
import math
import shutil
from collections import defaultdict
from pathlib import Path

import pytest
import torch


from ckptrun.runtime.checkpoint import snapshot, tensor_file, train_state
from ckptrun.runtime.checkpoint.dcp_io import load_metadata
from ckptrun.runtime.manifest import MANIFEST_NAME, read_manifest
from ckptrun.runtime.records import losses_by_attempt, read_events
from ckptrun.runtime.checkpoint.saver import Saver
from ckptrun.runtime.checkpoint.verify import verify_snapshot
from workers import run_job, shared_tensors

FSDP_JOB = Path(__file__).parent / "fixtures" / "fsdp_job.py"
STEPS = 12
FINAL = f"checkpoints/step-{STEPS:09d}"


def fsdp(run_dir: Path, **fields: object):
    return run_job(run_dir, nproc=2, script=FSDP_JOB, args=("--steps", str(STEPS)), save_every_steps=4, **fields)


@pytest.fixture(scope="session")
def fsdp_reference(tmp_path_factory) -> Path:
    """An uninterrupted FSDP2 run with async saves, shared by the tests below."""
    run_dir = tmp_path_factory.mktemp("fsdp") / "reference"
    result = fsdp(run_dir, async_save=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_fsdp2_killed_and_resumed_is_bitwise_identical(fsdp_reference, tmp_path, async_save):
    run_dir = tmp_path / "run"
    killed = fsdp(run_dir, async_save=async_save, fault="kill:rank=1:step=7")
    assert killed.returncode != 0, "the injected kill did not fire"
    resumed = fsdp(run_dir, async_save=async_save, attempt=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [e["step"] for e in read_events(run_dir, "restored")] == [4]
    expected = losses_by_attempt(fsdp_reference)[1]
    for attempt, losses in losses_by_attempt(run_dir).items():
        assert losses == {step: expected[step] for step in losses}, f"attempt {attempt} differs from the reference"
    ref, got = shared_tensors(fsdp_reference / FINAL), shared_tensors(run_dir / FINAL)
    assert ref.keys() == got.keys() and any(k.endswith(".exp_avg_sq") for k in ref), "every shard and moment stored"
    assert [k for k in ref if not torch.equal(ref[k], got[k])] == []
    for rank in (0, 1):
        name = f"rank-{rank:05d}.safetensors"
        rng_ref, rng_got = (tensor_file.decode((d / FINAL / name).read_bytes()) for d in (fsdp_reference, run_dir))
        assert all(torch.equal(rng_ref[k], rng_got[k]) for k in rng_ref)


def items_written_by_rank(snapshot_dir: Path) -> dict[int, int]:
    """Tensor bytes of every DCP item, by the rank whose file stores it (``__R_0.safetensors``)."""
    metadata = load_metadata(snapshot_dir / "dcp")
    written: dict[int, int] = defaultdict(int)
    for index, info in metadata.storage_data.items():
        item = metadata.state_dict_metadata[index.fqn]
        chunk = next(c for c in item.chunks if tuple(c.offsets) == tuple(index.offset))
        written[int(info.relative_path.split("_")[2])] += math.prod(chunk.sizes) * item.properties.dtype.itemsize
    return dict(written)


def state_bytes(snapshot_dir: Path) -> int:
    metadata = load_metadata(snapshot_dir / "dcp")
    return sum(math.prod(i.size) * i.properties.dtype.itemsize for i in metadata.state_dict_metadata.values())


def assert_staging_is_each_ranks_share(run_dir: Path) -> list[int]:
    saved = {e["step"]: e for e in read_events(run_dir, "snapshot_saved")}
    first = saved[min(saved)]
    written = items_written_by_rank(Path(first["path"]))
    assert first["staged_bytes_per_rank"] == [written.get(0, 0), written.get(1, 0)]
    assert first["staging_allocated_bytes_per_rank"] == first["staged_bytes_per_rank"], "first save allocates its share"
    assert sum(first["staged_bytes_per_rank"]) == state_bytes(Path(first["path"])), "the state, staged once per node"
    assert all(e["staging_allocated_bytes_per_rank"] == [0, 0] for s, e in saved.items() if s != min(saved))
    return first["staged_bytes_per_rank"]


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_fsdp2_ranks_stage_exactly_their_shards(fsdp_reference):
    per_rank = assert_staging_is_each_ranks_share(fsdp_reference)
    assert all(per_rank), "both ranks hold shards"


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_ddp_ranks_stage_only_the_replicated_tensors_dcp_assigns_them(tmp_path):
    run_dir = tmp_path / "ddp"
    result = run_job(run_dir, nproc=2, args=("--steps", "4", "--num-workers", "0"), save_every_steps=2, async_save=True)
    assert result.returncode == 0, result.stderr[-3000:]
    per_rank = assert_staging_is_each_ranks_share(run_dir)
    assert all(per_rank), "DCP spreads the replicated tensors over both ranks"


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_manifest_names_writer_ranks_and_global_shapes_and_verify_checks_them(fsdp_reference, tmp_path):
    final = fsdp_reference / FINAL
    manifest = read_manifest(final)
    assert manifest.schema_version == 3  # 2 added writer ranks and shapes, 3 chunk digests (test_chunk_digests.py)
    assert {f.path: f.rank for f in manifest.files if f.path.startswith("dcp/__")} == {
        "dcp/__0_0.safetensors": 0, "dcp/__1_0.safetensors": 1}
    assert manifest.tensors["model.0.weight"].shape == [32, 8] and manifest.tensors["model.0.weight"].dtype == "float32"
    assert verify_snapshot(final).ok

    lying = tmp_path / final.name
    shutil.copytree(final, lying)
    doc = json.loads((lying / MANIFEST_NAME).read_text())
    next(f for f in doc["files"] if f["path"] == "dcp/__1_0.safetensors")["rank"] = 0
    (lying / MANIFEST_NAME).write_text(json.dumps(doc))
    assert any("writer rank 0" in p for p in verify_snapshot(lying).problems)

    doc = json.loads((final / MANIFEST_NAME).read_text())
    doc["tensors"]["model.0.weight"]["shape"] = [8, 32]
    (lying / MANIFEST_NAME).write_text(json.dumps(doc))
    with pytest.raises(snapshot.LoadError, match="model.0.weight"):
        snapshot._read_local(lying, 0)


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(5, 4)
        self.head = torch.nn.Linear(4, 5, bias=False)
        self.head.weight = self.embed.weight


def _save(saver: Saver, objects: dict, step: int) -> snapshot.SaveResult:
    trees, tensors, aliases = train_state.collect(objects)
    state = snapshot.State({"objects": trees, "counters": {"step": step}, "config": {}, "aliases": aliases}, tensors,
                           {"rng": {}}, {})
    info = snapshot.SnapshotInfo("run", "line", None, step, 0, 0, "fp32", {}, "")
    results = []
    saver.begin(state, info, fault=lambda phase: None, on_result=results.append)
    saver.collect(wait=True)
    assert results[0].ok, results[0].error
    return results[0]


def test_tied_weights_are_stored_once_and_restored_tied(tmp_path):
    model = Tied()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model.head(model.embed(torch.tensor([1, 2]))).sum().backward()
    optimizer.step()
    saver = Saver(tmp_path, "sha256", asynchronous=True)
    result = _save(saver, {"model": model, "optimizer": optimizer}, 1)
    assert "model.head.weight" not in read_manifest(result.path).tensors, "stored once, under model.embed.weight"

    fresh = Tied()
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    objects = {"model": fresh, "optimizer": fresh_optimizer}
    loaded = snapshot.load(result.path, live=train_state.live_tensors(objects))
    train_state.apply(objects, loaded.shared_tree["objects"], loaded.shared_tensors)
    assert torch.equal(fresh.embed.weight, model.embed.weight) and fresh.head.weight is fresh.embed.weight
    moments = fresh_optimizer.state[fresh.embed.weight]["exp_avg"]
    assert torch.equal(moments, optimizer.state[model.embed.weight]["exp_avg"])


def test_two_saves_of_identical_tensors_at_different_steps_are_flagged_stale(tmp_path):
    model = torch.nn.Linear(3, 2)
    saver = Saver(tmp_path, "sha256", asynchronous=True)
    assert _save(saver, {"model": model}, 1).stale_of is None
    assert _save(saver, {"model": model}, 2).stale_of == 1, "nothing changed between steps 1 and 2"
    with torch.no_grad():
        model.weight.add_(1.0)
    assert _save(saver, {"model": model}, 3).stale_of is None
