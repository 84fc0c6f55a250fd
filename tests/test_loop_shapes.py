"""Issue 10 item 6: the epoch loop resumes exactly mid-epoch; the data position counts what steps consumed.

End-to-end: the epoch-loop fixture on 2 ranks (plain torchrun, the runtime picks the snapshot),
SIGKILLed mid-epoch by an injected fault and resumed, equals an uninterrupted run bitwise — with
``ckr.DataLoader`` and a ``next(iter(loader))`` probe every epoch, and with torchdata's
``StatefulDataLoader`` tracked as the loader. Units: probes, refusals, the untracked-loader warning.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import IterableDataset, TensorDataset

import ckptrun.runtime as ckr
from ckptrun.runtime.records import final_losses, read_events, read_metrics
from launch_helpers import FIXTURES, assert_losses_equal
from workers import run_job, shared_tensors

SCRIPT = FIXTURES / "epoch_loop.py"
EPOCHS, STEPS_PER_EPOCH = 3, 12  # 192 samples, 8 per rank, 2 ranks
FINAL = f"checkpoints/step-{EPOCHS * STEPS_PER_EPOCH:09d}"


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """One uninterrupted 2-rank run per loader kind, shared by the tests."""
    cache: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in cache:
            run_dir = tmp_path_factory.mktemp("epoch-reference") / kind
            result = run_job(run_dir, nproc=2, script=SCRIPT, args=("--loader", kind), save_every_steps=5)
            assert result.returncode == 0, result.stderr[-3000:]
            cache[kind] = run_dir
        return cache[kind]

    return get


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["ckr", "stateful"])
def test_epoch_loop_killed_mid_epoch_resumes_bitwise(uninterrupted, tmp_path, kind):
    reference = uninterrupted(kind)
    run_dir = tmp_path / kind
    killed = run_job(run_dir, nproc=2, script=SCRIPT, args=("--loader", kind), save_every_steps=5,
                     fault="kill:rank=1:step=17")  # epoch 1, five batches in; the snapshot is at step 15
    assert killed.returncode != 0, "the injected kill did not fire"
    resumed = run_job(run_dir, nproc=2, script=SCRIPT, args=("--loader", kind), save_every_steps=5, attempt=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [e["step"] for e in read_events(run_dir, "restored")] == [15]
    assert_losses_equal(run_dir, final_losses(reference))
    ours, theirs = shared_tensors(run_dir / FINAL), shared_tensors(reference / FINAL)
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours), "final state differs"
    assert "epoch 1 ends at step 24" in resumed.stdout and "epoch 2 ends at step 36" in resumed.stdout
    assert "data position not saved" not in killed.stderr + resumed.stderr
    if kind == "ckr":  # the probe took no batch from any epoch: 12 steps each, every sample seen once
        last = read_metrics(run_dir)[-1]
        assert (last["step"], last["samples_seen"]) == (36, 36 * 16)
        assert all("accuracy" in r for r in read_metrics(run_dir)), "end_step(accuracy=...) is logged"


@pytest.mark.timeout(120)
def test_untracked_plain_loader_warns_once_at_the_first_save(tmp_path):
    result = run_job(tmp_path / "plain", script=SCRIPT, args=("--loader", "plain", "--epochs", "1"), save_every_steps=5)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("data position not saved: a resume restarts this epoch") == 1


def _loader(samples: int = 20, batch_size: int = 2) -> ckr.DataLoader:
    dataset = TensorDataset(torch.arange(samples))
    return ckr.DataLoader(dataset, batch_size=batch_size, shuffle=True, seed=3)


def test_a_probe_or_an_unused_iterator_does_not_move_the_position():
    loader = _loader()
    (probe,) = next(iter(loader))
    unused = iter(loader)
    loop = iter(loader)
    (first,) = next(loop)
    assert torch.equal(first, probe), "the loop starts where the probe looked"
    loader.commit()  # a step consumed one batch
    assert loader.state_dict()["samples_consumed"] == 2
    again = _loader()
    again.load_state_dict(loader.state_dict())
    assert torch.equal(next(iter(again))[0], next(loop)[0]), "a resumed loader hands out the next unconsumed batch"
    del unused


def test_an_epoch_ends_when_the_loop_runs_out():
    loader = _loader()
    for _ in loader:
        loader.commit()
    assert (loader.epoch, loader.state_dict()["samples_consumed"], loader.samples_seen) == (1, 0, 20)


def test_ckr_dataloader_is_a_torch_dataloader_over_its_dataset():
    from ckptrun.runtime.step.loop import untracked_loader_in_use

    dataset = TensorDataset(torch.arange(20))
    loader = ckr.DataLoader(dataset, batch_size=2, shuffle=True, seed=3, num_workers=1, persistent_workers=True)
    assert isinstance(loader, torch.utils.data.DataLoader) and loader.dataset is dataset
    assert (len(loader), loader.batch_size, loader.num_workers) == (10, 2, 1)
    iterator = iter(loader)
    (first,) = next(iterator)
    loader.commit()
    assert untracked_loader_in_use([]) and not untracked_loader_in_use([loader]), "tracked: its dataset is covered"
    rest = [batch for (batch,) in iterator]
    in_process = [batch for (batch,) in _loader()]  # same seed, no worker process: the same order
    assert all(torch.equal(a, b) for a, b in zip([first, *rest], in_process, strict=True))
    assert loader.epoch == 1 and len([batch for batch in loader]) == 10, "a persistent worker starts the next epoch"


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(4))


def test_unresumable_inputs_are_refused_naming_the_alternative():
    with pytest.raises(TypeError, match="IterableDataset.*StatefulDataLoader") as streamed:
        ckr.DataLoader(Stream(), batch_size=2)
    dataset = TensorDataset(torch.arange(8))
    with pytest.raises(TypeError, match="sampler=.*StatefulDataLoader") as sampled:
        ckr.DataLoader(dataset, batch_size=2, sampler=torch.utils.data.SequentialSampler(dataset))
    assert "\n" not in str(streamed.value) + str(sampled.value)


def test_stateful_dataloader_state_is_stored_without_pickles():
    from torchdata.stateful_dataloader import StatefulDataLoader

    from ckptrun.runtime.checkpoint.treecodec import join, split

    loader = StatefulDataLoader(TensorDataset(torch.arange(20)), batch_size=4, shuffle=True)
    iterator = iter(loader)
    next(iterator)
    tree, tensors = split(loader.state_dict(), "loader")
    json.dumps(tree)  # JSON and tensors only
    resumed = StatefulDataLoader(TensorDataset(torch.arange(20)), batch_size=4, shuffle=True)
    resumed.load_state_dict(join(json.loads(json.dumps(tree)), tensors))
    assert torch.equal(next(iter(resumed))[0], next(iterator)[0])
