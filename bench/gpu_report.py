"""`make gpu-check`'s record: each check PASS or FAIL with its figure, one JSON document and a readable table.

A check is a function returning ``(passed, figure, detail)``; an exception is a FAIL with its first line.
The JSON document is rewritten after every check, so a check that runs past the machine's window still
leaves the ones before it on disk.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

CheckFn = Callable[[], "tuple[bool, str, dict[str, Any]]"]


class Report:
    def __init__(self, out: Path, header: dict[str, Any]) -> None:
        self.out, self.header, self.checks = out, header, []
        self.started = time.monotonic()

    def run(self, name: str, item: str, fn: CheckFn) -> dict[str, Any]:
        """Run one check (``item``: the issue's numbered item it proves), print its row, save the document."""
        started = time.monotonic()
        try:
            passed, figure, detail = fn()
            status = "PASS" if passed else "FAIL"
        except Exception as exc:  # noqa: BLE001 - a failed check is a row, not the end of the script
            status, figure = "FAIL", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
            detail = {"traceback": traceback.format_exc()[-4000:]}
        row = {"check": name, "item": item, "status": status, "figure": figure, "seconds": round(time.monotonic() - started, 1),
               "detail": detail}
        self.checks.append(row)
        print(f"{status:4}  {name:<44} {figure}  ({row['seconds']:.0f} s)", file=sys.stderr, flush=True)
        self.save()
        return row

    def document(self) -> dict[str, Any]:
        return {**self.header, "total_s": round(time.monotonic() - self.started, 1),
                "passed": sum(c["status"] == "PASS" for c in self.checks), "failed": sum(c["status"] == "FAIL" for c in self.checks),
                "checks": self.checks}

    def save(self) -> None:
        self.out.write_text(json.dumps(self.document(), indent=2, default=str))

    def table(self) -> str:
        """A markdown table (what the README's "GPUs" section shows)."""
        lines = ["| check | item | result | figure |", "|---|---|---|---|"]
        lines += [f"| {c['check']} | {c['item']} | {c['status']} | {c['figure']} |" for c in self.checks]
        return "\n".join(lines)
