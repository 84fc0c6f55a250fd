"""Issue 12 item 3: resume at another world size — tensors through DCP, the data position as one global cursor.

A DDP or FSDP2 job at a fixed global batch (``run.batches(..., global_batch=12)``) is SIGKILLed after
its step-5 snapshot and resumed on another number of ranks (plain torchrun, the runtime picks the
snapshot). The restored model and optimizer equal the full state at step 5 bitwise; every step
consumes the same samples as an uninterrupted 2-rank run (each index once per epoch); the losses
and final weights agree within fp32 tolerance, not bitwise: per-rank RNG is reseeded. Without
``--allow-reshard`` a world-size change is refused (exit 4) naming the flag.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch

from ckptrun.cli.supervision.resume_check import DIVERGED, WITHIN, ResumeWatch
from ckptrun.runtime.step.data import ResumableSampler
from ckptrun.runtime.manifest import read_manifest
from ckptrun.runtime.records import final_losses, read_events, read_fatal
from launch_helpers import FIXTURES, ckptrun, events, one
from workers import run_id_for, run_job, shared_tensors

SCRIPT = FIXTURES / "reshard_job.py"
STEPS, SNAPSHOT, STEPS_PER_EPOCH, SAMPLES = 10, 5, 4, 48  # global batch 12 of 48 samples
FINAL = f"checkpoints/step-{STEPS:09d}"


def job(run_dir: Path, nproc: int, kind: str, **fields: object):
    return run_job(run_dir, nproc=nproc, script=SCRIPT, args=("--parallel", kind, "--steps", str(STEPS)),
                   torchrun=True, save_every_steps=SNAPSHOT, precision="fp32", timeout=180, **fields)


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """One uninterrupted 2-rank run per parallelism, shared by the tests."""
    cache: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in cache:
            run_dir = tmp_path_factory.mktemp("reshard-reference") / kind
            result = job(run_dir, 2, kind)
            assert result.returncode == 0, result.stderr[-3000:]
            cache[kind] = run_dir
        return cache[kind]

    return get


@pytest.fixture(scope="session")
def killed(tmp_path_factory):
    """One run per parallelism and old world size SIGKILLed after its step-5 snapshot, shared by the tests that
    resume it at different world sizes (each resumes its own copy, under the killed run's id)."""
    cache: dict[tuple[str, int], Path] = {}

    def get(kind: str, old: int, into: Path) -> str:
        if (kind, old) not in cache:
            run_dir = tmp_path_factory.mktemp("reshard-killed") / f"{kind}-{old}"
            result = job(run_dir, old, kind, fault=f"kill:rank={old - 1}:step=7")  # the step-5 snapshot is published first
            assert result.returncode != 0, "the injected kill did not fire"
            cache[kind, old] = run_dir
        shutil.copytree(cache[kind, old], into)
        return run_id_for(cache[kind, old])

    return get


def consumed(run_dir: Path) -> dict[int, list[int]]:
    """Each step's sample indices across all ranks, from the last attempt that ran the step."""
    rows: dict[int, dict[int, list[int]]] = {}
    for line in (run_dir / "consumed.txt").read_text().splitlines():
        attempt, step, *indices = map(int, line.split())
        rows.setdefault(step, {}).setdefault(attempt, []).extend(indices)
    return {step: sorted(by_attempt[max(by_attempt)]) for step, by_attempt in rows.items()}


def assert_each_sample_once_per_epoch(stream: dict[int, list[int]]) -> None:
    assert sorted(stream) == list(range(1, STEPS + 1))
    for first in range(1, STEPS + 1, STEPS_PER_EPOCH):
        counts = Counter(i for step in range(first, min(first + STEPS_PER_EPOCH, STEPS + 1)) for i in stream[step])
        assert max(counts.values()) == 1, f"epoch from step {first} repeats {[i for i, n in counts.items() if n > 1]}"
        if first + STEPS_PER_EPOCH - 1 <= STEPS:
            assert sorted(counts) == list(range(SAMPLES)), f"epoch from step {first} skipped samples"


def assert_state_equal(ours: dict, theirs: dict, where: str) -> None:
    flat_ours, flat_theirs = _flatten(ours), _flatten(theirs)
    assert sorted(flat_ours) == sorted(flat_theirs), where
    differing = [k for k in flat_ours if not _same(flat_ours[k], flat_theirs[k])]
    assert not differing, f"{where}: {differing[:5]} differ"


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and a == b


def _flatten(tree: object, prefix: str = "") -> dict[str, object]:
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in _flatten(value, f"{prefix}{key}.").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, value in enumerate(tree) for k, v in _flatten(value, f"{prefix}{i}.").items()}
    return {prefix: tree}


@pytest.mark.e2e
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind, old, new", [("ddp", 2, 1), ("ddp", 2, 3), ("ddp", 3, 2), ("fsdp", 2, 1), ("fsdp", 2, 3)])
def test_resharded_resume_restores_the_state_and_continues_the_global_sample_stream(reference, killed, tmp_path, kind,
                                                                                  old, new):
    ref = reference(kind)
    run_dir = tmp_path / kind
    run_id = killed(kind, old, into=run_dir)
    if (kind, old, new) == ("ddp", 2, 1):  # not asked for: refused before anything is loaded
        refused = job(run_dir, new, kind, attempt=2, run_id=run_id)
        assert refused.returncode != 0
        fatal = read_fatal(run_dir)
        assert fatal and fatal[-1]["exit_code"] == 4 and "--allow-reshard" in fatal[-1]["reason"]
        assert "written by 2 ranks but this run has 1" in refused.stderr and "--allow-reshard" in refused.stderr
    resumed = job(run_dir, new, kind, attempt=2, allow_reshard=True, run_id=run_id)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    event = one(run_dir, "resharded")
    assert (event["step"], event["old_world_size"], event["new_world_size"], event["exact"]) == (SNAPSHOT, old, new, False)
    manifest = read_manifest(run_dir / FINAL)
    assert manifest.world_size == new
    assert manifest.world_size_history == [{"step": 0, "world_size": old}, {"step": SNAPSHOT, "world_size": new}]

    # the model and optimizer restored on `new` ranks are the full state the `old` ranks had at the snapshot
    at_snapshot = torch.load(run_dir / "state-attempt-1.pt", weights_only=True)
    restored = torch.load(run_dir / "state-attempt-2.pt", weights_only=True)
    assert_state_equal(restored, at_snapshot, "restored state")

    stream = consumed(run_dir)
    assert stream == consumed(ref), "the global sample stream differs from the uninterrupted run's"
    assert_each_sample_once_per_epoch(stream)

    losses, expected = final_losses(run_dir), final_losses(ref)
    assert sorted(losses) == sorted(expected)
    assert all(abs(losses[s] - expected[s]) <= 1e-4 * abs(expected[s]) for s in expected), (losses, expected)
    ours, theirs = shared_tensors(run_dir / FINAL), shared_tensors(ref / FINAL)
    assert sorted(ours) == sorted(theirs)
    assert all(torch.allclose(ours[k].float(), theirs[k].float(), rtol=1e-4, atol=1e-6) for k in ours)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_resume_at_another_world_size_needs_allow_reshard(tmp_path):
    run_dir = tmp_path / "run"
    common = ["--save-every-steps", "5", "--heartbeat-timeout", "5", "--startup-timeout", "60", "--precision", "fp32"]
    failed = ckptrun("launch", "--nproc-per-node", "2", "--run-dir", str(run_dir), "--max-restarts", "0", *common,
                     "--inject-fault", "kill:rank=0:step=6", str(SCRIPT), "--steps", "8", cwd=tmp_path, timeout=180)
    assert failed.returncode == 1, failed.stderr[-3000:]
    refused = ckptrun("resume", "--latest", "--run-dir", str(run_dir), "--nproc-per-node", "1", cwd=tmp_path)
    assert refused.returncode == 4, refused.stderr[-3000:]
    lines = refused.stderr.strip().splitlines()
    assert lines[-2].startswith("error: snapshot step 5 was written by 2 ranks") and "runs 1" in lines[-2]
    assert lines[-1].startswith("hint: pass --allow-reshard")
    assert json.loads((run_dir / "run.json").read_text())["spec"]["nproc_per_node"] == "2", "a refused resume changed run.json"
    assert len(events(run_dir, "attempt_start")) == 1, "a refused resume started ranks"

    resumed = ckptrun("resume", "--latest", "--run-dir", str(run_dir), "--nproc-per-node", "1", "--allow-reshard",
                      cwd=tmp_path, timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    event = one(run_dir, "resharded")
    assert (event["old_world_size"], event["new_world_size"]) == (2, 1)
    assert read_manifest(run_dir / "checkpoints" / f"step-{8:09d}").world_size == 1
    assert read_events(run_dir, "run_completed")


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_sampler_slices_each_micro_batch_of_one_permutation_by_rank(world):
    samplers = [ResumableSampler(48, rank, world, shuffle=True, seed=3, batch_size=2) for rank in range(world)]
    for sampler in samplers:
        sampler.start = 24  # two global batches of 12 consumed, at whatever world size
    perm, orders = samplers[0].permutation(), [s.order() for s in samplers]
    micro = 2 * world
    for j in range(24 // micro):
        handed = [i for order in orders for i in order[2 * j:2 * j + 2]]
        assert handed == perm[24 + j * micro:24 + (j + 1) * micro]


def test_a_resharded_resume_is_judged_within_tolerance_never_exact():
    original = {6: 0.5, 7: 0.25}
    same = ResumeWatch(dict(original), [], deterministic=True, resharded=True, precision="fp32")
    for step, loss in original.items():
        same.add({"step": step, "loss": loss})
    assert same.verdict().verdict == WITHIN and same.state() == WITHIN
    far = ResumeWatch(dict(original), [], deterministic=True, resharded=True, precision="fp32")
    far.add({"step": 6, "loss": 0.6})
    assert far.verdict().verdict == DIVERGED
