"""Fast in-process tests of the runtime's pure pieces: codec, policies, RNG, sampler, safe unpickling."""

from __future__ import annotations

import io
import math
import pickle
import random

import numpy as np
import pytest
import torch

from ckptrun.runtime.step import rng
from ckptrun.runtime.step.data import ResumableSampler
from ckptrun.runtime.checkpoint.dcp_io import RestrictedUnpickler, UnsafeMetadataError
from ckptrun.runtime.checkpoint.policies import FailedSaves, Retention, SaveCadence
from ckptrun.runtime.checkpoint.treecodec import join, split, tensor_keys


def test_optimizer_state_round_trips_through_json_and_tensors():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    state = optimizer.state_dict()
    tree, tensors = split(state, "optimizer")
    import json

    tree = json.loads(json.dumps(tree))
    assert sorted(tensor_keys(tree)) == sorted(tensors)
    back = join(tree, tensors)
    assert back["param_groups"] == state["param_groups"]
    assert set(back["state"]) == {0, 1}, "int keys survive"
    assert torch.equal(back["state"][0]["exp_avg"], state["state"][0]["exp_avg"])


def test_codec_keeps_tuples_floats_and_refuses_objects():
    tree, _ = split({"t": (1, 2.5), "nan": float("nan"), "f": 0.1 + 0.2}, "x")
    import json

    back = join(json.loads(json.dumps(tree)), {})
    assert back["t"] == (1, 2.5) and math.isnan(back["nan"]) and back["f"] == 0.1 + 0.2
    with pytest.raises(TypeError, match="cannot store object"):
        split({"bad": object()}, "x")


@pytest.mark.parametrize(
    "keep_last,keep_every,steps,deleted",
    [
        (3, None, [5, 10, 15, 20], [5]),
        (2, 10, [5, 10, 15, 20, 25], [5, 15]),
        (1, None, [5], []),
        (3, None, [10, 20], []),
        (0, None, [10, 20], [10]),  # never the newest, even with keep_last 0
    ],
)
def test_retention_table(keep_last, keep_every, steps, deleted):
    assert Retention(keep_last, keep_every).to_delete(steps) == deleted


def test_cadence_and_failed_save_budget():
    cadence = SaveCadence(every_steps=5, every_seconds=60)
    assert [s for s in range(0, 16) if cadence.step_due(s)] == [5, 10, 15]
    assert cadence.time_due(now=100.0, last_save=40.0) and not cadence.time_due(now=99.0, last_save=40.0)
    budget = FailedSaves(limit=3)
    assert [budget.record(ok) for ok in (False, False, True, False, False, False)] == [False, False, False, False, False, True]


def test_rng_capture_restore_replays_every_generator():
    rng.seed_everything(7)
    state, tensors = rng.capture()
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    rng.seed_everything(99)
    rng.restore(state, tensors)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first


def test_sampler_partitions_the_epoch_and_resumes_mid_epoch():
    samplers = [ResumableSampler(10, rank, 2, shuffle=True, seed=3) for rank in (0, 1)]
    orders = [s.order() for s in samplers]
    assert sorted(orders[0] + orders[1]) == list(range(10))
    samplers[0].start = 4  # global: two samples of each rank consumed
    assert list(samplers[0]) == orders[0][2:]
    assert [i for pair in zip(*orders) for i in pair] == samplers[0].permutation(), "each micro-batch sliced by rank"
    samplers[0].epoch = 1
    assert samplers[0].order() != orders[0], "reshuffled per epoch"


class Boom:
    def __reduce__(self):
        return (print, ("ran",))


def test_restricted_unpickler_refuses_code():
    with pytest.raises(UnsafeMetadataError, match="builtins.print"):
        RestrictedUnpickler(io.BytesIO(pickle.dumps(Boom()))).load()
    assert RestrictedUnpickler(io.BytesIO(pickle.dumps(torch.Size([2, 3])))).load() == torch.Size([2, 3])


@pytest.mark.parametrize(
    "saved,current,allowed,refused",
    [
        ({"lr": 0.1, "steps": 10}, {"lr": 0.1, "steps": 20}, (), []),  # run length may change
        ({"lr": 0.1}, {"lr": 0.2}, (), ["lr"]),
        ({"lr": 0.1}, {"lr": 0.2}, ("lr",), []),
        ({"lr": 0.1, "out_dir": "a", "save_every": 5}, {"lr": 0.1, "out_dir": "b", "save_every": 9}, (), []),
        ({"dropout": 0.1}, {}, (), ["dropout"]),  # a key that disappeared is a change too
    ],
)
def test_config_change_table(saved, current, allowed, refused):
    from ckptrun.runtime.checkpoint.policies import refused_changes

    assert refused_changes(saved, current, allowed) == refused


def _window_verdict(history: list[float], loss: float, sigma: float) -> bool:
    """The definition: above mean + sigma * std of the window (population std), summed afresh."""
    mean = sum(history) / len(history)
    std = math.sqrt(sum((x - mean) ** 2 for x in history) / len(history))
    return std > 0 and loss > mean + sigma * std


@pytest.mark.parametrize("base,spread", [(2.3, 0.05), (1e4, 1e-6), (0.0, 1.0)])
def test_anomaly_running_sums_agree_with_the_window(base, spread):
    """The O(1) running sums flag exactly what the window's own mean and std flag, flat losses included."""
    from ckptrun.runtime.step.anomaly import AnomalyDetector

    detector, rng_ = AnomalyDetector(window=20, sigma=3.0), random.Random(0)
    for step in range(600):
        loss = base + spread * (rng_.gauss(0, 1) + (8 if step % 37 == 36 else 0))
        before = list(detector.history)
        expected = len(before) >= detector.min_history and _window_verdict(before, loss, detector.sigma)
        assert (detector.check(loss) is not None) == expected, step
        if step == 300:
            detector.history.clear()  # a rollback forgets the window
    assert detector.check(float("nan")) == "non-finite loss nan"


def test_heartbeat_file_is_rewritten_in_place_and_read_whole(tmp_path):
    """In-place beats: each read sees the last whole beat; a shorter beat leaves no tail; a fork does not write."""
    import os

    from ckptrun.runtime.worker.liveness import Heartbeater
    from ckptrun.runtime.records import heartbeat_path, read_heartbeat, read_heartbeats

    heart = Heartbeater(tmp_path, 3, 1, interval=3600.0)
    assert heart.beat(123456789, "train") and not heart.beat(123456790, "train")  # throttled
    assert heart.beat(7, "save")  # a phase change always writes
    beat = read_heartbeats(tmp_path)[3]
    assert (beat.step, beat.phase, beat.pid, beat.source) == (7, "save", os.getpid(), "runtime")
    path = heartbeat_path(tmp_path, 3)
    path.write_bytes(path.read_bytes()[:40])  # a write caught half done
    assert read_heartbeat(path) is None and read_heartbeats(tmp_path) == {}
    pid = os.fork()
    if pid == 0:  # a data-loader worker inherits the heartbeater: it must not beat for its parent
        heart.beat(99, "done", force=True)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert read_heartbeat(path) is None, "the fork wrote its parent's heartbeat"  # still the torn 40 bytes
    assert heart.beat(8, "train", force=True) and read_heartbeats(tmp_path)[3].step == 8
