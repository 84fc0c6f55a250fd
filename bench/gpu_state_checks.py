"""`make gpu-check`'s in-process half on one GPU: what staging costs the device, how long it stalls, restore speed.

* **FSDP2 staging allocates no device memory** (item 2): a 1-rank FSDP2 model with AdamW state on the
  GPU, saved through the runtime's own :class:`Saver` (async: owned keys, preflight, stage, persist,
  publish); the device's allocated bytes and their peak are read before and during the save.
  The staged tensors are host DTensors around pinned buffers, equal to the shards.
* **Staging stall against a D2H floor**: the time ``stage()`` holds the training thread and the time
  until its copies are done, against one pinned ``copy_`` of the same bytes.
* **Restore of a 1 GiB state** (model + AdamW moments) into the live GPU tensors, every byte verified,
  against ``torch.load(map_location="cuda", weights_only=True)`` of the same state; both from the page
  cache (each file read once before), best of two, interleaved.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ckptrun.runtime import collectives
from ckptrun.runtime.checkpoint import snapshot, train_state
from ckptrun.runtime.checkpoint.saver import Saver
from ckptrun.runtime.checkpoint.staging import Stager, local
from ckptrun.runtime.storage import store

GiB = 1 << 30


def start_one_rank_group() -> None:
    """The group a 1-GPU worker joins (``cpu:gloo,cuda:nccl``, bound to GPU 0), as ``init()`` starts it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0"})
    collectives.start(torch.device("cuda", 0))


def _model_state(layers: int, hidden: int, fsdp: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(layers)]).cuda()
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(8, hidden, device="cuda")).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def _state(objects: dict[str, Any], step: int) -> snapshot.State:
    trees, tensors, aliases = train_state.collect(objects)
    tree = {"objects": trees, "counters": {"step": step, "epoch": 0, "rollbacks": 0}, "config": {}, "aliases": aliases}
    return snapshot.State(tree, tensors, {}, {})


def _info(ckpt_dir: Path, step: int) -> snapshot.SnapshotInfo:
    lineage = store.ensure_lineage(ckpt_dir, "gpu-check").current
    return snapshot.SnapshotInfo(run_id="gpu-check", lineage=lineage, parent=None, step=step, epoch=0, samples_seen=0,
                                 precision="fp32", config={}, code_version="gpu-check")


def fsdp_staging_device_bytes(scratch: Path) -> tuple[bool, str, dict[str, Any]]:
    model, optimizer = _model_state(layers=8, hidden=2048, fsdp=True)  # ~34M params: 0.4 GB with both AdamW moments
    objects = {"model": model, "optimizer": optimizer}
    saver = Saver(scratch / "fsdp-ckpt", "sha256", asynchronous=True)
    peaks = []
    for step in (1, 2):  # the first save allocates the host buffers, the second reuses them
        state = _state(objects, step)  # the state dicts (FSDP2: DTensor shards, no gather) before the save
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        saver.begin(state, _info(saver.ckpt_dir, step), fault=lambda _: None, on_result=lambda _: None)
        staged_peak = torch.cuda.max_memory_allocated()
        [result] = saver.collect(wait=True)
        torch.cuda.synchronize()
        peaks.append({"before": before, "peak_during_stage": staged_peak, "peak_until_published": torch.cuda.max_memory_allocated(),
                      "after": torch.cuda.memory_allocated(), "ok": result.ok, "error": result.error})
    staged = saver.stager.stage(state.shared_tensors)
    saver.stager.fence()
    on_host = all(not local(t).is_cuda for t in staged.values())
    pinned = all(local(staged[k]).is_pinned() for k, t in state.shared_tensors.items() if local(t).is_cuda)
    equal = all(torch.equal(local(staged[k]).cpu(), local(t).cpu()) for k, t in state.shared_tensors.items())
    growth = max(p["peak_until_published"] - p["before"] for p in peaks)
    state_bytes = sum(local(t).numel() * local(t).element_size() for t in state.shared_tensors.values())
    passed = growth == 0 and on_host and pinned and equal and all(p["ok"] for p in peaks)
    figure = (f"device bytes allocated by two saves of {state_bytes / GiB:.2f} GiB of shards: {growth} "
              f"(allocated {peaks[0]['before'] / GiB:.2f} GiB before, peak {max(p['peak_until_published'] for p in peaks) / GiB:.2f} GiB during)")
    return passed, figure, {"saves": peaks, "state_bytes": state_bytes, "host": on_host, "pinned": pinned, "equal": equal}


def staging_stall_vs_copy_floor() -> tuple[bool, str, dict[str, Any]]:
    tensors = {f"t{i}": torch.randn(32 << 20, device="cuda") for i in range(4)}  # 512 MiB in 4 tensors
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    stager = Stager()
    stager.stage(tensors)  # allocates (pins) the buffers once, as the first save of a run
    stager.fence()
    stalls, copies = [], []
    for _ in range(3):
        torch.cuda.synchronize()
        started = time.perf_counter()
        stager.stage(tensors)
        stalls.append(time.perf_counter() - started)
        stager.fence()
        copies.append(time.perf_counter() - started)
    floor_buffer = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=True)
    source = torch.cat([t.flatten() for t in tensors.values()])
    floors = []
    for _ in range(3):
        torch.cuda.synchronize()
        started = time.perf_counter()
        floor_buffer.copy_(source, non_blocking=True)
        torch.cuda.synchronize()
        floors.append(time.perf_counter() - started)
    stall, copy, floor = min(stalls), min(copies), min(floors)
    passed = copy <= 1.5 * floor + 0.005 and stall <= copy
    figure = (f"{nbytes / 2**20:.0f} MiB: stage() holds the step {stall * 1e3:.1f} ms, copies done after {copy * 1e3:.1f} ms; "
              f"floor (one pinned D2H copy) {floor * 1e3:.1f} ms = {nbytes / floor / 1e9:.1f} GB/s; copy/floor {copy / floor:.2f}")
    return passed, figure, {"bytes": nbytes, "stall_s": stalls, "copy_s": copies, "floor_s": floors}


def restore_vs_torch_load(scratch: Path) -> tuple[bool, str, dict[str, Any]]:
    from ckptrun.runtime.checkpoint.verify import verify_snapshot

    model, optimizer = _model_state(layers=5, hidden=4096, fsdp=False)  # 84M params x 12 bytes ~ 1.0 GiB
    objects = {"model": model, "optimizer": optimizer}
    saver = Saver(scratch / "restore-ckpt", "sha256", asynchronous=False)
    state = _state(objects, 1)
    saver.begin(state, _info(saver.ckpt_dir, 1), fault=lambda _: None, on_result=lambda _: None)
    [result] = saver.collect(wait=True)
    assert result.ok, result.error
    torch_file = scratch / "state.pt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, torch_file)
    expected = {k: t.detach().cpu().clone() for k, t in state.shared_tensors.items()}
    nbytes = sum(t.numel() * t.element_size() for t in expected.values())
    for path in [torch_file, *result.path.rglob("*")]:
        if path.is_file():
            path.read_bytes()  # both from the page cache
    ours, theirs = [], []
    for _ in range(2):
        live = train_state.live_tensors(objects)
        for tensor in live.values():
            tensor.detach().zero_()
        torch.cuda.synchronize()
        started = time.perf_counter()
        assert verify_snapshot(result.path, at_load=True).ok
        snapshot.load(result.path, live=live)
        torch.cuda.synchronize()
        ours.append(time.perf_counter() - started)
        started = time.perf_counter()
        loaded = torch.load(torch_file, map_location="cuda", weights_only=True)
        torch.cuda.synchronize()
        theirs.append(time.perf_counter() - started)
        del loaded
    live = train_state.live_tensors(objects)
    exact = all(torch.equal(live[k].detach().cpu(), expected[k]) for k in expected)
    ratio = min(ours) / min(theirs)
    passed = exact and ratio <= 3.0
    figure = (f"{nbytes / GiB:.2f} GiB into the live GPU tensors, verified: {min(ours):.2f} s; torch.load to cuda "
              f"{min(theirs):.2f} s; ratio {ratio:.2f} (page cache); restored bitwise: {exact}")
    return passed, figure, {"bytes": nbytes, "ckptrun_s": ours, "torch_load_s": theirs}


def run_all(report: Any) -> None:
    scratch = Path(tempfile.mkdtemp(prefix="gpu-check-state-"))
    start_one_rank_group()
    try:
        report.run("FSDP2 staging: device memory during saves", "2", lambda: fsdp_staging_device_bytes(scratch))
        report.run("staging stall vs D2H copy floor", "2, 3", staging_stall_vs_copy_floor)
        report.run("restore 1 GiB vs torch.load to GPU", "-", lambda: restore_vs_torch_load(scratch))
    finally:
        dist.destroy_process_group()
