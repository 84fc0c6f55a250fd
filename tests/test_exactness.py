"""Invariant 3 (exact): a run killed at any step and resumed equals the uninterrupted run bitwise.

Real torchrun, 2 ranks, gloo on CPU, the default template (dropout, shuffling,
two loader workers, AdamW, cosine schedule, EMA). The runtime picks and
verifies the snapshot itself here (plain torchrun, no supervisor). Cases that share a run share it:
without accumulation one run is killed right after a save (attempt 1), then mid-epoch (attempt 2).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckptrun.runtime.checkpoint import tensor_file

from ckptrun.runtime.records import losses_by_attempt, read_events
from workers import run_job, shared_tensors

STEPS = 30
FINAL = f"checkpoints/step-{STEPS:09d}"


def job_args(accumulate: int) -> tuple[str, ...]:
    return ("--steps", str(STEPS), "--accumulate", str(accumulate))


@pytest.fixture(scope="session")
def reference(tmp_path_factory, default_job_run):
    """Uninterrupted 2-rank runs, one per accumulation setting, shared by every test (without accumulation:
    conftest's `ckptrun launch` of the same job, which computes the same bits as plain torchrun)."""
    cache: dict[int, Path] = {1: default_job_run}

    def get(accumulate: int) -> Path:
        if accumulate not in cache:
            run_dir = tmp_path_factory.mktemp("reference") / f"acc{accumulate}"
            result = run_job(run_dir, nproc=2, args=job_args(accumulate), save_every_steps=5)
            assert result.returncode == 0, result.stderr[-3000:]
            cache[accumulate] = run_dir
        return cache[accumulate]

    return get


TWICE = "kill:rank=0:step=10;kill:rank=1:step=13:attempt=2"  # attempt 1 right after a save, attempt 2 mid-epoch
CASES = [
    # name, accumulate, faults (one run: each fault kills one attempt), the attempt whose resume is checked, its snapshot
    ("mid-epoch", 1, TWICE, 3, 10),
    ("right-after-save", 1, TWICE, 2, 10),
    ("inside-accumulation-window", 2, "kill:rank=1:step=13:micro=1", 2, 10),
]


@pytest.fixture(scope="session")
def killed_and_resumed(tmp_path_factory):
    """Runs killed once per fault and resumed until they complete, shared by the cases that check them."""
    cache: dict[tuple[int, str], Path] = {}

    def get(accumulate: int, faults: str) -> Path:
        if (accumulate, faults) not in cache:
            run_dir = tmp_path_factory.mktemp("killed") / f"acc{accumulate}"
            kills = faults.count(";") + 1
            for attempt in range(1, kills + 1):
                killed = run_job(run_dir, nproc=2, args=job_args(accumulate), save_every_steps=5, fault=faults, attempt=attempt)
                assert killed.returncode != 0, f"the injected kill of attempt {attempt} did not fire"
            resumed = run_job(run_dir, nproc=2, args=job_args(accumulate), save_every_steps=5, fault=faults,
                              attempt=kills + 1)
            assert resumed.returncode == 0, resumed.stderr[-3000:]
            cache[accumulate, faults] = run_dir
        return cache[accumulate, faults]

    return get


@pytest.mark.timeout(420)
@pytest.mark.parametrize("name,accumulate,faults,attempt,resumed", CASES, ids=[c[0] for c in CASES])
def test_killed_and_resumed_run_is_bitwise_identical(reference, killed_and_resumed, name, accumulate, faults, attempt,
                                                     resumed):
    ref = reference(accumulate)
    run_dir = killed_and_resumed(accumulate, faults)
    restored = {e["attempt"]: e["step"] for e in read_events(run_dir, "restored")}
    assert restored[attempt] == resumed, restored
    expected = losses_by_attempt(ref)[1]
    attempts = losses_by_attempt(run_dir)
    assert sorted(restored) == sorted(attempts)[1:], "every later attempt restored once"
    steps = sorted(attempts[attempt])  # the checked attempt goes on from the first step after its snapshot
    assert steps == list(range(resumed + 1, resumed + 1 + len(steps)))
    assert max(attempts[max(attempts)]) == STEPS
    for number, losses in attempts.items():  # a replayed step equals its first run: both equal the reference
        mismatched = {step: (loss, expected[step]) for step, loss in losses.items() if loss != expected[step]}
        assert not mismatched, f"attempt {number} differs from the uninterrupted run: {mismatched}"

    assert_same_snapshot_state(ref / FINAL, run_dir / FINAL)


def assert_same_snapshot_state(a: Path, b: Path) -> None:
    """Parameters, optimizer, EMA, scheduler, data position and every rank's RNG, bitwise."""
    tensors_a, tensors_b = shared_tensors(a), shared_tensors(b)
    assert tensors_a.keys() == tensors_b.keys()
    assert any(key.startswith("optimizer.state.") for key in tensors_a)
    different = [key for key in tensors_a if not torch.equal(tensors_a[key], tensors_b[key])]
    assert not different, f"tensors differ: {different[:5]}"
    assert json.loads((a / "state.json").read_text()) == json.loads((b / "state.json").read_text())
    for rank in (0, 1):
        assert (a / f"rank-{rank:05d}.json").read_text() == (b / f"rank-{rank:05d}.json").read_text()
        rng_a = tensor_file.decode((a / f"rank-{rank:05d}.safetensors").read_bytes())
        rng_b = tensor_file.decode((b / f"rank-{rank:05d}.safetensors").read_bytes())
        assert all(torch.equal(rng_a[k], rng_b[k]) for k in rng_a)


# A snapshot of 2 ranks refused on 1 without --allow-reshard (exit 4, naming the flag): test_reshard.py's
# test_resharded_resume_restores_the_state_and_continues_the_global_sample_stream[ddp-2-1] asserts it first.
