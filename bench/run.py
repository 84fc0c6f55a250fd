"""ckptrun's benchmark suite: every figure against a baseline measured in the same run.

    python bench/run.py --quick     # one small state, 5 repeats, ~5 minutes on 2 cores
    python bench/run.py --full      # ~256 MiB and ~1 GiB of model + AdamW state

Prints one table per state size and the goals of issue 6 (ratio, PASS/MISS),
then issue 13's table (every figure a ratio from this run, with its goal) and
the per-step runtime work part by part, on stdout; narrates progress on
stderr, and writes every figure (median, min, max, samples, cache state,
world size) to bench/results/latest.json. See bench/README.md for what each
key means.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import Figure, MiB, build_state, failed, init_world, load_average

MODES = {  # sizes in MiB of model + AdamW state, repeats, template steps per A/B run
    "quick": {"sizes": [64], "repeats": 5, "template_steps": 60, "alone_s": 0.3},
    "full": {"sizes": [256, 1024], "repeats": 5, "template_steps": 300, "alone_s": 1.0},
}


def narrate(text: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')} load {' '.join(map(str, load_average()))}] {text}", file=sys.stderr, flush=True)


def blake3_available() -> bool:
    try:
        import blake3  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        return False
    return True


def measure_size(mib: int, repeats: int, scratch: Path, blake3: bool, alone_s: float) -> tuple[dict[str, Figure], list[float], dict[str, Any]]:
    """Every per-size section on one state; the state and its files are gone when this returns."""
    import snapshots

    scratch.mkdir(parents=True, exist_ok=True)
    state = build_state(mib * MiB)
    meta: dict[str, Any] = {"state_bytes": state.nbytes, "tensor_bytes": state.tensors_bytes, "load_avg": {}}
    narrate(f"{mib} MiB: writing the snapshots the read benchmarks read (1 and 2 ranks)")
    snaps = snapshots.prepare(state, scratch / "fixtures", ["sha256", "blake3"] if blake3 else ["sha256"], repeats)
    figures: dict[str, Figure] = {}
    for name, step in sections(state, snaps, scratch, repeats, blake3, alone_s):
        narrate(f"{mib} MiB: {name}")
        meta["load_avg"][name] = load_average()
        try:
            figures.update(step())
        except Exception as exc:  # noqa: BLE001 - one broken section must not hide the others' figures
            narrate(f"{mib} MiB: {name} failed: {type(exc).__name__}: {exc}")
            figures[f"error: {name}"] = failed(exc)
    return figures, snaps.all_reduce_s, meta


def sections(state: Any, snaps: Any, scratch: Path, repeats: int, blake3: bool, alone_s: float) -> list[tuple[str, Callable[[], dict[str, Figure]]]]:
    import async_saves
    import restore
    import sync_saves
    import verify_speed

    return [("async saves", lambda: async_saves.measure(state, scratch / "async", repeats, alone_s)),
            ("sync saves", lambda: sync_saves.measure(state, scratch / "sync", repeats, blake3)),
            ("restore", lambda: restore.measure(snaps, repeats)),
            ("verify and hashing", lambda: verify_speed.measure(snaps, repeats, blake3))]


def measure_global(repeats: int, steps: int, scratch: Path, all_reduce: list[float]) -> dict[str, Figure]:
    import runtime_overhead
    import startup

    narrate("start-up: ckptrun --help vs python -c pass")
    figures = startup.measure(repeats)
    narrate(f"runtime overhead: per-call costs, template A/B ({steps} steps per run)")
    figures.update(runtime_overhead.measure(scratch / "runtime", repeats, steps, all_reduce))
    return figures


# --- output ---------------------------------------------------------------------------


def _num(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value * 1e6:.1f}us" if value < 1e-3 else f"{value * 1e3:.2f}ms" if value < 1 else f"{value:.3f}s"
    return f"{value:.3f}"


def print_table(title: str, figures: dict[str, Figure], verdicts: list[dict[str, Any]]) -> None:
    print(f"\n== {title}")
    print(f"{'key':44} {'median':>10} {'min':>10} {'max':>10}  {'unit':5} {'world':>5}  cache")
    for key, fig in figures.items():
        if fig.error:
            print(f"{key:44} {'ERROR':>10}  {fig.error[:90]}")
            continue
        unit = "" if fig.unit == "s" else fig.unit
        print(f"{key:44} {_num(fig.median, fig.unit):>10} {_num(min(fig.samples), fig.unit):>10} "
              f"{_num(max(fig.samples), fig.unit):>10}  {unit:5} {fig.world_size:>5}  {fig.cache}")
    if verdicts:
        print(f"\n{'goal':70} {'ratio':>8} {'med/med':>8} {'limit':>6}  verdict   (ratio: median of per-round ratios)")
        for v in verdicts:
            ratio = "-" if v["ratio"] is None else f"{v['ratio']:.3f}"
            of_medians = "-" if v.get("ratio_of_medians") is None else f"{v['ratio_of_medians']:.3f}"
            print(f"{v['goal']:70} {ratio:>8} {of_medians:>8} {v['limit']:>6g}  {v['verdict']} {v['detail']}")


def issue_13_table(label: str, figures: dict[str, Figure]) -> list[dict[str, Any]]:
    """Issue 13's goals over one state size's figures and the size-independent ones."""
    import goals

    print(f"\n== issue 13: every figure a ratio measured in this run ({label} state for the snapshot rows)")
    verdicts = goals.evaluate(figures, goals.ISSUE_13)
    print(f"{'goal':76} {'ratio':>8} {'limit':>6}  verdict")
    for v in verdicts:
        ratio = "-" if v["ratio"] is None else f"{v['ratio']:.3f}"
        print(f"{v['goal']:76} {ratio:>8} {v['limit']:>6g}  {v['verdict']} {v['detail']}")
    return verdicts


def print_breakdown(figures: dict[str, Figure]) -> None:
    """The per-step runtime work, part by part (2 ranks, the timed pass of step_work.py)."""
    import runtime_overhead

    if "runtime_per_step_s" not in figures or figures["runtime_per_step_s"].error:
        return
    total, step = figures["runtime_per_step_s"].median, figures["template_step_w2_s"].median
    print(f"\n== per-step runtime work: {total * 1e6:.1f}us per step = {total / step:.2%} of a {step * 1e3:.2f}ms template step (2 ranks)")
    print(f"{'part':20} {'per step':>10} {'share':>7}")
    for part in (*runtime_overhead.PARTS, "other"):
        print(f"{part:20} {_num(figures[f'step_part_{part}_s'].median, 's'):>10} {figures[f'share_{part}'].median:>7.1%}")


def git_version() -> str:
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, cwd=HERE,
                              check=False).stdout.strip()
    except OSError:
        return ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--quick", action="store_const", const="quick", dest="mode", help="one small state (< 3 min)")
    mode.add_argument("--full", action="store_const", const="full", dest="mode", help="~256 MiB and ~1 GiB states")
    parser.add_argument("--repeats", type=int, help="interleaved repeats per figure (default 5; at least 5 for a report)")
    parser.add_argument("--sizes", help="comma-separated state sizes in MiB, instead of the mode's")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "latest.json")
    parser.add_argument("--scratch", type=Path, default=HERE / "results" / "scratch", help="where snapshots are written")
    parser.add_argument("--runtime-only", action="store_true", help="only the size-independent figures (start-up, runtime overhead)")
    parser.add_argument("--sizes-only", action="store_true", help="only the per-size figures (snapshots: issue 27's goals)")
    args = parser.parse_args()

    config = dict(MODES[args.mode])
    repeats = args.repeats or config["repeats"]
    sizes = [] if args.runtime_only else [int(s) for s in args.sizes.split(",")] if args.sizes else config["sizes"]
    warnings.filterwarnings("ignore")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    started, load_start = time.time(), load_average()
    blake3 = blake3_available()
    import torch

    init_world()  # world size 1 through a real gloo group, as under torchrun
    results: dict[str, Any] = {"mode": args.mode, "repeats": repeats, "started": started, "load_avg_start": load_start,
                               "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                                        "blake3": blake3, "platform": platform.platform()},
                               "code": git_version(), "sizes": {}}
    tables: list[tuple[str, dict[str, Figure]]] = []
    all_reduce: list[float] = []
    try:
        for mib in sizes:
            figures, reduce, meta = measure_size(mib, repeats, args.scratch / f"{mib}MiB", blake3, config["alone_s"])
            all_reduce = all_reduce or reduce
            gc.collect()
            shutil.rmtree(args.scratch / f"{mib}MiB", ignore_errors=True)
            tables.append((f"{mib} MiB", figures))
            results["sizes"][f"{mib}MiB"] = {**meta, "figures": figures}
        global_figures = {} if args.sizes_only else measure_global(repeats, config["template_steps"], args.scratch, all_reduce)
        if args.mode == "full" and not args.sizes_only:  # ~4 min: kill -> first step under ckptrun, ft_launcher and torchrun (peer_restart.py)
            import peer_restart

            narrate("restart side by side: ckptrun vs ft_launcher vs torchrun, 5 interleaved rounds")
            global_figures.update(peer_restart.figures(rounds=5))
            import object_store  # ~1 min: 64 MiB save/restore against a local moto S3 server vs the local disk

            narrate("object store: save and restore of 64 MiB to a local S3 server (moto) vs the local disk")
            global_figures.update(object_store.figures(args.scratch / "object-store", repeats))
            import memory_tier  # ~4 min: one kill with and without --memory-every-steps: lost steps, RTO (memory_tier.py)

            narrate("memory tier: lost steps and RTO for a kill, with and without it, 3 interleaved rounds")
            global_figures.update(memory_tier.figures(args.scratch / "memory-tier", repeats=3))
    finally:
        shutil.rmtree(args.scratch, ignore_errors=True)
    tables.append(("size-independent", global_figures))
    import goals

    for label, figures in tables:
        least = goals.least_dcp_slowdown(figures)
        if least is not None:  # issue 27: the persist must slow training no more than the best DCP async mode
            figures["dcp_least_train_slowdown"] = least
        small = label != "size-independent" and int(label.split()[0]) < 1024  # issue 27: within 20% below 1 GiB
        verdicts = goals.evaluate(figures, small=small)
        section = results["sizes"][label.replace(" ", "")] if label != "size-independent" else results.setdefault("global", {"figures": global_figures})
        section["goals"] = verdicts
        section["figures"] = {key: fig.to_json() | {"samples": fig.samples} for key, fig in figures.items()}
    results["load_avg_end"], results["seconds"] = load_average(), time.time() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"ckptrun bench --{args.mode}: {repeats} interleaved repeats; load average {load_start} at start, "
          f"{results['load_avg_end']} at end; {results['seconds']:.0f} s; torch {torch.__version__}, {os.cpu_count()} CPUs")
    for label, figures in tables:
        print_table(label, figures, results["sizes"][label.replace(" ", "")]["goals"] if label != "size-independent" else results["global"]["goals"])
    results["issue13"] = {}
    for label, figures in tables[:-1] or [("no", {})]:  # --runtime-only: the size-independent rows alone
        combined = {**figures, **global_figures}
        results["issue13"][label.replace(" ", "")] = issue_13_table(label, combined)
    print_breakdown(global_figures)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
