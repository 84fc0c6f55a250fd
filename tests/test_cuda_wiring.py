"""The CUDA wiring, pinned on CPU: one group "cpu:gloo,cuda:nccl" bound to LOCAL_RANK's GPU, every
control-plane collective on a CPU tensor (gloo), the snapshot group gloo.

The public ``torch.distributed`` calls are captured by recording wrappers; the
"CUDA is available" decision is forced through ``collectives.worker_device(cuda=True)``
(torch.cuda itself is not touched). The recorded ``init_process_group`` then starts a
real one-rank gloo group, so every collective after it runs for real.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from ports import free_port

from ckptrun.runtime import collectives
from ckptrun.runtime.step import stepper
from ckptrun.runtime.step.precision import Policy, resolve

RECORDED = ("init_process_group", "new_group", "all_reduce", "broadcast", "all_gather", "barrier")


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple, dict]]:
    """Record every call of RECORDED (public names and the module-level ones torch calls internally)."""
    log: list[tuple[str, tuple, dict]] = []
    real_init = c10d.init_process_group

    def fake_init(*args: Any, **kwargs: Any) -> None:  # no NCCL on this machine: a real gloo group stands in
        log.append(("init_process_group", args, kwargs))
        real_init("gloo")

    for name in RECORDED:
        real = fake_init if name == "init_process_group" else getattr(c10d, name)

        def wrapper(*args: Any, _name: str = name, _real: Any = real, **kwargs: Any) -> Any:
            if _name != "init_process_group":
                log.append((_name, args, kwargs))
            return _real(*args, **kwargs)

        monkeypatch.setattr(c10d, name, wrapper)
        monkeypatch.setattr(dist, name, wrapper)
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "3", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    yield log
    if dist.is_initialized():
        dist.destroy_process_group()


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


def test_cuda_worker_joins_one_group_with_two_backends_bound_to_local_rank(calls: list) -> None:
    device = collectives.worker_device(cuda=True)
    collectives.start(device, set_device=lambda d: calls.append(("set_device", (d,), {})))
    assert device == torch.device("cuda", 3)  # LOCAL_RANK's GPU, made current before the group (NCCL, FSDP2 use it)
    assert [name for name, _, _ in calls][:2] == ["set_device", "init_process_group"], calls
    assert calls[0][1] == (device,)
    [(_, args, kwargs)] = [c for c in calls if c[0] == "init_process_group"]
    assert (args, kwargs) == (("cpu:gloo,cuda:nccl",), {"device_id": torch.device("cuda", 3)})


def test_control_plane_collectives_use_cpu_tensors_and_the_snapshot_group_is_gloo(calls: list,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    collectives.start(collectives.worker_device(cuda=True), set_device=lambda device: None)
    with monkeypatch.context() as two_ranks:  # a world of one sums nothing: claim two so the sum goes over the wire
        two_ranks.setattr(collectives.dist, "get_world_size", lambda group=None: 2)
        assert collectives.all_reduce_sum([1.0, 2.0]) == [1.0, 2.0]  # the per-step decisions
    assert collectives.broadcast_object({"snapshot": "step-5"}) == {"snapshot": "step-5"}
    assert collectives.all_gather_object("ok") == ["ok"]
    group = collectives.new_group()  # the background saver's own group
    assert collectives.broadcast_object("temp", group=group) == "temp"

    model = torch.nn.Linear(4, 1)  # an fp16 step whose gradient holds an inf: the found-inf flag is all-reduced
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = Policy(resolve("fp16", "cpu")).make_scaler()
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    model.weight.grad[0, 0] = float("inf")
    with monkeypatch.context() as two_ranks:
        two_ranks.setattr(collectives.dist, "get_world_size", lambda group=None: 2)
        assert stepper.optimizer_step(model, optimizer, scaler, max_norm=None).skipped

    collective = [(name, args, kwargs) for name, args, kwargs in calls if name in ("all_reduce", "broadcast", "all_gather")]
    assert {name for name, *_ in collective} == {"all_reduce", "broadcast", "all_gather"}
    assert sum(name == "all_reduce" for name, *_ in collective) == 3  # all_reduce_sum, the found-inf flag, zero grads
    devices = {t.device for _, args, kwargs in collective for t in _tensors(args, kwargs)}
    assert devices == {torch.device("cpu")}
    [(_, args, kwargs)] = [c for c in calls if c[0] == "new_group"]
    assert kwargs.get("backend") == "gloo"


def test_cpu_worker_uses_gloo_and_binds_no_device(calls: list) -> None:
    bound: list[torch.device] = []
    collectives.start(collectives.worker_device(cuda=False), set_device=bound.append)
    [(_, args, kwargs)] = [c for c in calls if c[0] == "init_process_group"]
    assert (args, kwargs, bound) == (("gloo",), {}, [])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: `make gpu-check` runs for real")
def test_gpu_check_skips_cleanly_without_a_gpu() -> None:
    check = Path(__file__).parent.parent / "bench" / "gpu_check.py"
    result = subprocess.run([sys.executable, str(check)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("gpu-check: skipped: no CUDA device"), result
