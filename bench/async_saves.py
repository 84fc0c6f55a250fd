"""What an async save costs the training loop: ckptrun against DCP ``async_save`` in every mode.

Per repeat, interleaved, on the same model + AdamW state in this process
(world size 1, a real gloo group):

* ``staging_floor_s`` — the state copied into buffers that already exist;
* ``save_stall_s`` — ckptrun: building the snapshot state (what ``Run.save``
  does) and ``Saver.begin`` until it returns (preflight + stage). On CPU there
  is no later fence or staging wait, so that is everything the loop waits;
* ``dcp_async_block_*`` — the ``dcp.async_save`` call with the default stager
  (the FileSystemWriter's own staging), a persistent reused ``DefaultStager``,
  PROCESS mode, and background staging (whose stall includes the wait for the
  staging future, before the weights may change again);
* while each save persists, a small training loop (the template's model) keeps
  stepping in this process: its median step time ÷ its median step time alone
  alone, is the ``*train_slowdown_during_persist`` figure. "Alone" is the round's: the median
  of every variant's steps alone in that round (each trial steps alone just before and just
  after its save), so every saver of a round is divided by the same baseline and a load that
  drifts between rounds moves both sides of a comparison; the time
  from the call's return until the snapshot is published is ``*persist_s``;
* ``*train_lost_during_persist_s`` — the loop's step time during the persist beyond what the
  same steps take alone: the training seconds one save costs. A slowdown is a rate over the
  persist's window, so a writer that takes longer at a lower rate scores better on it for the
  same seconds lost; this figure compares savers whose persists differ in length;
* ``persist_idle_s`` — ckptrun's persist with nothing running alongside.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import (
    MEMORY,
    NA,
    WRITTEN,
    BigState,
    Figure,
    ProbeLoop,
    failed,
    interleave,
    save_once,
    settle,
)

DAEMON_LOG = Path(__file__).resolve().parent / "results" / "dcp-daemon.log"


class Variant:
    """One async saver: ``start()`` returns (seconds the loop waited, a done-predicate, a done-time getter)."""

    def __init__(self, name: str, start: Callable[[], tuple[float, Callable[[], bool], Callable[[], float]]],
                 cleanup: Callable[[], None]) -> None:
        self.name, self.start, self.cleanup = name, start, cleanup


def _ckptrun_variant(state: BigState, scratch: Path) -> Variant:
    from ckptrun.runtime.checkpoint.saver import Saver

    saver = Saver(scratch / "ckptrun-async", "sha256", asynchronous=True)
    save_once(saver, state)  # allocates the staging buffers once, as the first save of a run does
    settle(saver)

    def start() -> tuple[float, Callable[[], bool], Callable[[], float]]:
        finished: list[float] = []
        started = time.perf_counter()
        save_once(saver, state, on_result=lambda result: finished.append(time.perf_counter()))
        stall = time.perf_counter() - started
        return stall, lambda: bool(finished), lambda: finished[0]

    return Variant("ckptrun", start, lambda: settle(saver))


def _dcp_variant(name: str, state: BigState, scratch: Path, **options: Any) -> Variant:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    root = scratch / f"dcp-{name}"
    root.mkdir(parents=True, exist_ok=True)
    counter = [0]
    pending: list[Any] = []

    def start() -> tuple[float, Callable[[], bool], Callable[[], float]]:
        counter[0] += 1
        finished: list[float] = []
        started = time.perf_counter()
        response = dcp.async_save(state.natural_state_dict(), storage_writer=FileSystemWriter(root / str(counter[0])), **options)
        if hasattr(response, "staging_completion"):  # background staging: the weights must not change before it ends
            response.staging_completion.result()
            response = response.upload_completion
        stall = time.perf_counter() - started
        response.add_done_callback(lambda _: finished.append(time.perf_counter()))
        pending.append(response)
        return stall, lambda: bool(finished), lambda: finished[0]

    def cleanup() -> None:
        while pending:
            pending.pop().result()
        shutil.rmtree(root / str(counter[0]), ignore_errors=True)
        _idle_staging_thread_gone(options.get("async_stager"))

    return Variant(name, start, cleanup)


def _idle_staging_thread_gone(stager: Any) -> None:
    """End a background-staging stager's worker thread after its save (a new one starts at its next save).

    The thread copied the state with torch ops, so it holds an OpenMP team of its own; while that thread
    lives, the probe loop's steps take ~2.3x as long on 2 cores (measured: 2.6 ms -> 6.0 ms alone, back to
    2.6 ms once it ends). Left alive it would slow every later trial of every saver and the steps alone
    they are divided by. The stager and its cached buffers are kept; only the idle thread goes.
    """
    from concurrent.futures import ThreadPoolExecutor

    executor = getattr(stager, "_staging_executor", None)  # torch 2.13's DefaultStager
    if executor is not None:
        executor.shutdown(wait=True)
        stager._staging_executor = ThreadPoolExecutor(max_workers=1)


@contextlib.contextmanager
def _quiet_fds(log: Path):
    """DCP's checkpoint daemon logs to the stdout it inherits at spawn; give it a log file instead."""
    sys.stdout.flush()
    sys.stderr.flush()
    log.parent.mkdir(parents=True, exist_ok=True)
    saved = os.dup(1), os.dup(2)
    with open(log, "ab") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def _variants(state: BigState, scratch: Path) -> tuple[list[Variant], dict[str, str], list[Any]]:
    """Every saver, warmed up by one save (buffers allocated, daemon started); modes that fail give an error."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    stagers = [DefaultStager(StagingOptions(False, False, False, False)), DefaultStager(StagingOptions(False, False, True, False))]
    candidates = {
        "ckptrun": lambda: _ckptrun_variant(state, scratch),
        "dcp": lambda: _dcp_variant("dcp", state, scratch),
        "dcp_reused": lambda: _dcp_variant("dcp_reused", state, scratch, async_stager=stagers[0]),
        "dcp_process": lambda: _dcp_variant("dcp_process", state, scratch, async_checkpointer_type=AsyncCheckpointerType.PROCESS),
        "dcp_bgstaging": lambda: _dcp_variant("dcp_bgstaging", state, scratch, async_stager=stagers[1]),
    }
    variants, errors = [], {}
    for name, make in candidates.items():
        try:
            with _quiet_fds(DAEMON_LOG) if name == "dcp_process" else contextlib.nullcontext():
                variant = make()
                variant.start()
                variant.cleanup()
            variants.append(variant)
        except BaseException as exc:  # DCP raises CheckpointException (a BaseException) for failed saves
            if isinstance(exc, KeyboardInterrupt):
                raise
            errors[name] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    return variants, errors, stagers


def _trial(variant: Variant, loop: ProbeLoop, alone_s: float) -> Callable[[], dict[str, float]]:
    def run() -> dict[str, float]:
        before = loop.for_seconds(alone_s)
        stall, done, done_at = variant.start()
        returned = time.perf_counter()
        process_cpu, loop_cpu = time.process_time(), time.thread_time()
        during = loop.until(done)
        # CPU this process spent beside the loop's own thread while the save persisted: the writer's share
        # (the loop's intra-op threads count too; DCP's process mode writes in another process: not seen here)
        beside = (time.process_time() - process_cpu) - (time.thread_time() - loop_cpu)
        persist = done_at() - returned
        variant.cleanup()
        # the baseline brackets the save (steps alone just before and just after it), so a load that
        # drifts during the trial (other processes on a shared machine) moves both sides alike
        alone = statistics.median(before + loop.for_seconds(alone_s / 2))
        return {f"{variant.name}.stall": stall, f"{variant.name}.persist": persist,
                f"{variant.name}.during": statistics.median(during), f"{variant.name}.alone": alone,
                f"{variant.name}.lost": sum(during) - len(during) * alone, f"{variant.name}.cpu": beside}

    return run


def _slowdowns(samples: dict[str, list[float]], names: list[str]) -> None:
    """``<name>.slowdown`` per round: the variant's median step while persisting ÷ the round's step alone (the
    median of every variant's alone median in that round; ``interleave`` runs each trial once per round)."""
    if not names:
        return
    rounds = zip(*(samples[f"{name}.alone"] for name in names))
    alone = [statistics.median(values) for values in rounds]
    for name in names:
        samples[f"{name}.slowdown"] = [during / base for during, base in zip(samples[f"{name}.during"], alone)]


def _idle_trial(variant: Variant) -> Callable[[], dict[str, float]]:
    """The same ckptrun save with no training alongside: what the writer does when nobody competes."""
    def run() -> dict[str, float]:
        _, done, done_at = variant.start()
        returned, cpu = time.perf_counter(), time.process_time()
        while not done():
            time.sleep(0.002)
        persist, cpu = done_at() - returned, time.process_time() - cpu
        variant.cleanup()
        return {"persist_idle_s": persist, "persist_idle_cpu_s": cpu, "persist_idle_cpu_share": cpu / persist}

    return run


def _floor_trial(state: BigState) -> Callable[[], dict[str, float]]:
    import torch

    tensors = state.collect().shared_tensors
    buffers = {key: torch.empty_like(t) for key, t in tensors.items()}
    for key, tensor in tensors.items():  # first touch outside the timing: the floor is a copy into warm buffers
        buffers[key].copy_(tensor)

    def run() -> dict[str, float]:
        started = time.perf_counter()
        for key, tensor in state.collect().shared_tensors.items():
            buffers[key].copy_(tensor)
        return {"floor": time.perf_counter() - started}

    return run


KEYS = {  # variant -> (stall key, persist key, slowdown key)
    "ckptrun": ("save_stall_s", "persist_s", "train_slowdown_during_persist"),
    "dcp": ("dcp_async_block_s", "dcp_persist_s", "dcp_train_slowdown_during_persist"),
    "dcp_reused": ("dcp_async_block_reused_s", "dcp_persist_reused_s", "dcp_train_slowdown_during_persist_reused"),
    "dcp_process": ("dcp_async_block_process_s", "dcp_persist_process_s", "dcp_train_slowdown_during_persist_process"),
    "dcp_bgstaging": ("dcp_async_stall_bgstaging_s", "dcp_persist_bgstaging_s", "dcp_train_slowdown_during_persist_bgstaging"),
}
LOST = {name: slowdown.replace("slowdown", "lost") + "_s" for name, (_, _, slowdown) in KEYS.items()}
NOTES = {
    "save_stall_s": "state_dict + split + rng capture + Saver.begin (preflight, stage); no fence on CPU",
    "dcp_async_block_s": "dcp.async_save call, FileSystemWriter's own staging (fresh buffers)",
    "dcp_async_block_reused_s": "persistent DefaultStager(StagingOptions(False, False, False, False))",
    "dcp_async_block_process_s": "AsyncCheckpointerType.PROCESS (daemon started by a warm-up save)",
    "dcp_async_stall_bgstaging_s": "DefaultStager(use_async_staging=True): call + wait for staging_completion",
    "persist_s": "call returned -> published (sha256 while writing, fsync, manifest, rename), loop stepping alongside",
    "train_slowdown_during_persist": "median step of a ~0.9M-param loop while persisting / the round's step alone (every saver's, before and after its save)",
}


def measure(state: BigState, scratch: Path, repeats: int, alone_s: float = 0.3) -> dict[str, Figure]:
    """``alone_s``: seconds the probe loop steps alone right before each save, its baseline."""
    scratch.mkdir(parents=True, exist_ok=True)
    loop = ProbeLoop()
    variants, errors, stagers = _variants(state, scratch)
    trials = {"floor": _floor_trial(state), **{v.name: _trial(v, loop, alone_s) for v in variants}}
    if variants and variants[0].name == "ckptrun":
        trials["ckptrun_idle"] = _idle_trial(variants[0])
    samples = interleave(repeats, trials)
    for stager in stagers:
        stager.close()
    _slowdowns(samples, [v.name for v in variants])
    figures = {"staging_floor_s": Figure(samples["floor"], "s", MEMORY, note="copy into existing buffers")}
    for name, (stall, persist, slowdown) in KEYS.items():
        if name in errors:
            for key in (stall, persist, slowdown, LOST[name]):
                figures[key] = failed(errors[name], "s" if key.endswith("_s") else "x")
            continue
        figures[stall] = Figure(samples[f"{name}.stall"], "s", MEMORY, note=NOTES.get(stall, ""))
        figures[persist] = Figure(samples[f"{name}.persist"], "s", WRITTEN, note=NOTES.get(persist, ""))
        if name != "dcp_process":
            figures[persist.replace("persist", "persist_cpu", 1)] = Figure(
                samples[f"{name}.cpu"], "s", NA, note="CPU seconds this process spent beside the loop's thread while persisting")
        figures[slowdown] = Figure(samples[f"{name}.slowdown"], "x", NA, note=NOTES.get(slowdown, ""))
        figures[LOST[name]] = Figure(samples[f"{name}.lost"], "s", NA, note="training seconds the persist cost the loop")
    if "persist_idle_s" in samples:
        figures["persist_idle_s"] = Figure(samples["persist_idle_s"], "s", WRITTEN, note="as persist_s, with no training alongside")
        figures["persist_idle_cpu_s"] = Figure(samples["persist_idle_cpu_s"], "s", NA, note="the process's CPU seconds during it")
        figures["persist_idle_cpu_share"] = Figure(samples["persist_idle_cpu_share"], "x", NA,
                                                   note="CPU seconds per second of the idle persist (cores the writer keeps busy)")
    if "ckptrun.alone" in samples:
        figures["probe_step_alone_s"] = Figure(samples["ckptrun.alone"], "s", NA, note="the probe loop's step, alone")
    return figures
