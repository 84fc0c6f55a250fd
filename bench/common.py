"""Shared benchmark helpers: figures, interleaved repeats, page-cache eviction, the state under test.

Every figure is a list of samples from interleaved repeats (each repeat runs
every variant once, in an order rotated per repeat, so a slow minute of the
machine hits A and B alike) reported as median, min and max, with the cache
state its reads came from and the world size that wrote or ran it.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MiB = 1 << 20
CACHED, EVICTED, WRITTEN, MEMORY, NA = "page-cached", "evicted (fsync + POSIX_FADV_DONTNEED)", "write + fsync", "memory", "n/a"
HIDDEN = 1024  # width of the Linear stack that makes up the big state


# --- figures --------------------------------------------------------------------


@dataclass
class Figure:
    """One measured quantity: its samples and how to read them."""

    samples: list[float]
    unit: str
    cache: str
    world_size: int = 1
    note: str = ""
    error: str | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.samples) if self.samples else float("nan")

    def to_json(self) -> dict[str, Any]:
        if self.error is not None:
            return {"error": self.error, "unit": self.unit, "cache": self.cache, "world_size": self.world_size, "note": self.note}
        return {"median": self.median, "min": min(self.samples), "max": max(self.samples), "n": len(self.samples),
                "unit": self.unit, "cache": self.cache, "world_size": self.world_size, "note": self.note}


def failed(error: BaseException | str, unit: str = "s", cache: str = NA, world_size: int = 1) -> Figure:
    """A figure that could not be measured: the error string takes the place of the numbers."""
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return Figure([], unit, cache, world_size, error=text.strip().splitlines()[0][:300] if text.strip() else "failed")


def interleave(repeats: int, trials: dict[str, Callable[[], dict[str, float]]]) -> dict[str, list[float]]:
    """Run every trial once per repeat, rotating the order; collect each returned key's samples."""
    names = list(trials)
    samples: dict[str, list[float]] = {}
    for repeat in range(repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            for key, value in trials[name]().items():
                samples.setdefault(key, []).append(value)
    return samples


def ratio_samples(numerators: list[float], denominators: list[float]) -> list[float]:
    """Per-repeat ratios of two figures measured in the same repeats."""
    return [a / b for a, b in zip(numerators, denominators) if b > 0]


def median_of(fn: Callable[[], Any], calls: int) -> float:
    """Median seconds of ``calls`` calls of ``fn`` (for per-call costs of microseconds)."""
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


# --- files and the page cache -----------------------------------------------------


def files_under(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def total_bytes(paths: Iterable[Path]) -> int:
    return sum(p.stat().st_size for p in paths)


def evict(path: Path) -> None:
    """Drop a file's (or a tree's) pages from the page cache: fsync so they are clean, then DONTNEED."""
    for file in files_under(path):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(path: Path) -> None:
    """Read a file (or a tree) once so that the next read comes from the page cache."""
    buffer = bytearray(8 * MiB)
    for file in files_under(path):
        with open(file, "rb", buffering=0) as stream:
            while stream.readinto(buffer):
                pass


def write_fsync(path: Path, write: Callable[[Any], Any]) -> None:
    with open(path, "wb") as stream:
        write(stream)
        stream.flush()
        os.fsync(stream.fileno())


# --- processes ---------------------------------------------------------------------


def _tests_ports() -> Any:
    """tests/ports.py, the suite's port helper (ports below the kernel's ephemeral range, probed): one for both."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ckptrun_test_ports", Path(__file__).resolve().parent.parent / "tests" / "ports.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


free_port = _tests_ports().free_port


def init_world(rank: int = 0, world_size: int = 1, port: int | None = None) -> None:
    """A real gloo process group (world size 1 for the in-process figures, as under torchrun)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port or free_port()}", rank=rank, world_size=world_size)


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# --- the state under test ---------------------------------------------------------------


@dataclass
class BigState:
    """A stack of Linear layers with AdamW state initialised by one step: params + exp_avg + exp_avg_sq."""

    model: Any
    optimizer: Any
    nbytes: int = 0
    step: int = 0
    tensors_bytes: int = field(default=0)

    def natural_state_dict(self) -> dict[str, Any]:
        """What a plain torch.save / DCP user would hand over."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def collect(self) -> Any:
        """The snapshot.State ckptrun's Run._collect builds at a save (state_dicts split, RNG captured)."""
        from ckptrun.runtime.step import rng
        from ckptrun.runtime.checkpoint import snapshot
        from ckptrun.runtime.checkpoint.treecodec import split

        trees, tensors = {}, {}
        for name, obj in (("model", self.model), ("optimizer", self.optimizer)):
            trees[name], own = split(obj.state_dict(), name)
            tensors.update(own)
        rng_tree, rng_tensors = rng.capture()
        self.step += 1
        tree = {"objects": trees, "counters": {"step": self.step, "rollbacks": 0}, "config": {}}
        return snapshot.State(tree, tensors, {"rng": rng_tree}, rng_tensors)


def build_state(nbytes: int, seed: int = 0) -> BigState:
    """~``nbytes`` of fp32 model + AdamW state (12 bytes per parameter)."""
    import torch

    torch.manual_seed(seed)
    per_layer = 12 * (HIDDEN * HIDDEN + HIDDEN)
    layers = max(1, round(nbytes / per_layer))
    model = torch.nn.Sequential(*[torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(4, HIDDEN)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    state = BigState(model, optimizer)
    state.tensors_bytes = sum(t.numel() * t.element_size() for t in state.collect().shared_tensors.values())
    state.nbytes = layers * per_layer
    return state


def snapshot_info(ckpt_dir: Path, step: int) -> Any:
    from ckptrun.runtime.checkpoint import snapshot
    from ckptrun.runtime.storage import store

    lineage = store.ensure_lineage(ckpt_dir, "bench").current
    return snapshot.SnapshotInfo(run_id="bench", lineage=lineage, parent=None, step=step, epoch=0, samples_seen=0,
                                 precision="fp32", config={}, code_version="bench")


def save_once(saver: Any, state: BigState, on_result: Callable[[Any], None] = lambda _: None) -> None:
    """Start one ckptrun save of ``state`` (staged on return; async persists in the background)."""
    shared = state.collect()
    saver.begin(shared, snapshot_info(saver.ckpt_dir, state.step), fault=lambda _: None, on_result=on_result)


def settle(saver: Any) -> Any:
    """Wait for the save in flight; delete what it published; return its result."""
    from ckptrun.runtime.storage import store

    results = saver.collect(wait=True)
    if not results or not results[-1].ok:
        raise RuntimeError(f"ckptrun save failed: {results[-1].error if results else 'no result'}")
    store.delete_snapshot(results[-1].path)
    return results[-1]


# --- a small training loop that runs while a save persists ----------------------------------


class ProbeLoop:
    """The default template's model (~0.9M params, batch 32, AdamW) stepping in this process."""

    def __init__(self, seed: int = 0) -> None:
        import torch
        from torch import nn

        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(32, 64, generator=generator)
        self.y = torch.randint(0, 10, (32,), generator=generator)
        self.model = nn.Sequential(nn.Linear(64, 640), nn.GELU(), nn.Linear(640, 640), nn.GELU(),
                                   nn.Linear(640, 640), nn.GELU(), nn.Linear(640, 10))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.steps(20)

    def step(self) -> float:
        import torch.nn.functional as F

        started = time.perf_counter()
        loss = F.cross_entropy(self.model(self.x), self.y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        float(loss.detach())
        return time.perf_counter() - started

    def steps(self, count: int) -> list[float]:
        return [self.step() for _ in range(count)]

    def for_seconds(self, seconds: float, minimum: int = 10) -> list[float]:
        started, times = time.perf_counter(), []
        while time.perf_counter() - started < seconds or len(times) < minimum:
            times.append(self.step())
        return times

    def until(self, done: Callable[[], bool], minimum: int = 1) -> list[float]:
        """Step until ``done()`` (at least ``minimum`` steps, so that a fast save still yields a figure)."""
        times = []
        while not done() or len(times) < minimum:
            times.append(self.step())
        return times
