"""Choose the background writer's settings by measurement: niceness and pacing duty, side by side.

    python bench/writer_settings.py 10:1.0 5:1.0 10:0.5 --dcp dcp_bgstaging --repeats 10

Each ``NICE:DUTY`` is one ckptrun async saver (``Saver(nice=, duty=)``, see
``runtime/checkpoint/saver.py`` and ``runtime/checkpoint/pacing.py``); ``--dcp`` adds DCP modes from
``async_saves.py``. Every repeat runs each of them once on the same (64 MiB by default)
model + AdamW state (``--mib``) with the same probe loop, in rotated order, plus a sync
save (``save_total_s``, the bound of issue 6: ``persist_s <= 2 x save_total_s``).
Per saver it prints the median training slowdown during the persist, the
training seconds the persist cost (``lost``: comparable across persists of
different lengths), and the persist time. Take figures with ``uptime`` < 2:
under load every sample moves by more than the settings do.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import MiB, ProbeLoop, build_state, init_world, interleave, load_average, save_once, settle


def _ckptrun(state, scratch: Path, nice: int, duty: float):
    import async_saves
    from ckptrun.runtime.checkpoint.saver import Saver

    saver = Saver(scratch / f"nice{nice}-duty{duty}", "sha256", asynchronous=True, nice=nice, duty=duty)
    save_once(saver, state)
    settle(saver)

    def start():
        finished: list[float] = []
        started = time.perf_counter()
        save_once(saver, state, on_result=lambda _: finished.append(time.perf_counter()))
        return time.perf_counter() - started, lambda: bool(finished), lambda: finished[0]

    return async_saves.Variant(f"nice{nice}:duty{duty}", start, lambda: settle(saver))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("settings", nargs="+", help="NICE:DUTY, e.g. 10:1.0 (duty 1.0: no pauses)")
    parser.add_argument("--dcp", default="", help="comma-separated DCP modes of async_saves.py to run alongside")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--alone-s", type=float, default=0.3)
    parser.add_argument("--mib", type=int, default=64, help="MiB of model + AdamW state (default 64)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import async_saves
    from ckptrun.runtime.checkpoint.saver import Saver

    init_world()
    state = build_state(args.mib * MiB)
    scratch = Path(tempfile.mkdtemp(prefix="writer-settings-"))
    try:
        loop = ProbeLoop()
        variants = [_ckptrun(state, scratch, int(n), float(d)) for n, d in (s.split(":") for s in args.settings)]
        wanted = [m for m in args.dcp.split(",") if m]
        dcp, errors, stagers = async_saves._variants(state, scratch) if wanted else ([], {}, [])
        variants += [v for v in dcp if v.name in wanted]
        sync = Saver(scratch / "sync", "sha256", asynchronous=False)

        def sync_trial() -> dict[str, float]:
            started = time.perf_counter()
            save_once(sync, state)
            total = time.perf_counter() - started
            settle(sync)
            return {"save_total": total}

        load = load_average()
        samples = interleave(args.repeats, {**{v.name: async_saves._trial(v, loop, args.alone_s) for v in variants}, "sync": sync_trial})
        async_saves._slowdowns(samples, [v.name for v in variants])  # each over the round's step alone
        print(f"{args.repeats} interleaved repeats, load {load} -> {load_average()}; errors: {errors or 'none'}")
        print(f"save_total_s (sync) {statistics.median(samples['save_total']):.3f}")
        print(f"{'saver':22} {'slowdown':>9} {'lost_s':>8} {'persist_s':>10}")
        for v in variants:
            s, lost, p = (statistics.median(samples[f"{v.name}.{k}"]) for k in ("slowdown", "lost", "persist"))
            print(f"{v.name:22} {s:9.3f} {lost:8.3f} {p:10.3f}")
        for stager in stagers:
            stager.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
