"""`make matrix`: run the scenario matrix's cover (or the cells named) and write bench/results/matrix.json.

    python bench/matrix.py                         # the cover: every applicable pair of axis values, the hardest triples
    python bench/matrix.py --cells 2x2/fsdp2/memory-replica/lose-node,1x2/ddp/local/kill
    python bench/matrix.py --list                  # the cover and the not-applicable pairs, with reasons; runs nothing

Prints one line per cell (PASS / FAIL with its one-line reason / n/a with why) as it goes, then the counts
and the pairs of axis values no cell can hold; exit 1 when a cell failed. The harness lives with the tests
(tests/matrix.py: the axes, the rules and the cover; tests/matrix_cells.py: one cell run and judged).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

import matrix  # noqa: E402
from matrix_cells import Harness, print_table, run_cell  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "matrix.json"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", default=os.environ.get("CELLS") or None,
                        help="comma-separated cells topology/state/tier/fault (default: the cover)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON goes")
    parser.add_argument("--list", action="store_true", help="print the cells and the n/a pairs; run nothing")
    args = parser.parse_args()
    try:
        cells = [matrix.Cell.parse(text) for text in args.cells.split(",")] if args.cells else matrix.cover()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.list:
        for cell in cells:
            print(f"{cell.name}  ~{matrix.cost(cell):.0f}s  {matrix.not_applicable(cell) or ''}")
        _print_uncoverable()
        return 0
    print(f"matrix: {len(cells)} cell(s), ~{sum(matrix.cost(c) for c in cells) / 60:.0f} min estimated", file=sys.stderr)
    verdicts = []
    with tempfile.TemporaryDirectory(prefix="ckptrun-matrix-") as scratch:
        harness = Harness(Path(scratch), start_s3=lambda: _start_s3(Path(scratch)))
        started = time.monotonic()
        try:
            for cell in cells:
                verdict = run_cell(cell, harness)
                verdicts.append(verdict)
                print_table([verdict])
                _write(args.out, verdicts, complete=False)  # a partial run keeps what it found
        finally:
            if harness.s3 is not None:
                harness.s3.stop()
    counts = {v: sum(1 for x in verdicts if x.verdict == v) for v in ("PASS", "FAIL", "n/a")}
    print(f"matrix: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['n/a']} n/a in "
          f"{(time.monotonic() - started) / 60:.1f} min", file=sys.stderr)
    if not args.cells:
        _print_uncoverable()
    _write(args.out, verdicts, complete=True)
    print(f"matrix: wrote {args.out}", file=sys.stderr)
    return 1 if counts["FAIL"] else 0


def _write(out: Path, verdicts: list, complete: bool) -> None:  # type: ignore[type-arg]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"complete": complete, "cells": [v.as_json() for v in verdicts],
                               "not_applicable_pairs": _uncoverable_json()}, indent=1) + "\n")


def _start_s3(root: Path):  # type: ignore[no-untyped-def]
    from s3_server import start_server

    return start_server(root / "moto.log")


def _uncoverable_json() -> list[dict[str, str]]:
    return [{"pair": f"{a[0]}={a[1]} x {b[0]}={b[1]}", "reason": reason}
            for (a, b), reason in sorted(matrix.uncoverable_pairs().items())]


def _print_uncoverable() -> None:
    pairs = _uncoverable_json()
    print(f"matrix: {len(pairs)} pair(s) of axis values no cell can hold:", file=sys.stderr)
    for row in pairs:
        print(f"  n/a  {row['pair']}: {row['reason']}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
