"""Child processes that ``ckptrun estimate-rto`` times: a no-op rank, and a snapshot load with no user code.

Usage (never typed by people; :mod:`ckptrun.cli.recovery_budget.rto_measure` starts them):

* ``python -m ckptrun.cli.recovery_budget.rto_probe noop READY_DIR`` — a rank that does what
  every relaunched rank does before the user's code matters: start, import
  torch and the runtime, open the run's object store (``CKPTRUN_CKPT_URL``, as
  a rank of such a run does), join the process group (under torchrun), then write
  ``READY_DIR/rank-R`` with the time and wait to be torn down.
* ``python -m ckptrun.cli.recovery_budget.rto_probe load SNAPSHOT_DIR`` — read and
  deserialise one snapshot the way a restoring rank does (the runtime's own
  loader: DCP through the restricted reader, ``torch.load(weights_only=True)``,
  JSON), into tensors allocated from the snapshot's metadata; print one JSON
  line of timings.

This module plays a worker, so unlike the rest of ``cli/`` it imports the
runtime's torch side — only inside these functions, in the child process; the
CLI itself never imports it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def _since_process_start() -> float:
    import psutil

    return time.time() - psutil.Process().create_time()


def noop(ready_dir: Path) -> int:
    import torch.distributed as dist

    import ckptrun.runtime.step.session  # noqa: F401 - the imports a runtime rank pays for
    from ckptrun.runtime.env import variable

    store = os.environ.get(variable("ckpt_url"))
    if store:  # an object-store run's rank opens its store's client as it starts
        from ckptrun.runtime.storage.remote_store import open_store

        open_store(store, os.environ.get(variable("storage_options")))
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
        dist.barrier()
    rank = int(os.environ.get("RANK", "0"))
    ready_dir.mkdir(parents=True, exist_ok=True)
    (ready_dir / f"rank-{rank}").write_text(json.dumps({"time": time.time(), "since_process_start": _since_process_start(),
                                                        "store": bool(store)}))
    while True:  # torn down by SIGTERM, as a real attempt is
        time.sleep(3600)


def load(snapshot_dir: Path) -> int:
    python_start_s = _since_process_start()
    started = time.monotonic()
    import torch  # noqa: F401

    from ckptrun.runtime.checkpoint import snapshot

    imported = time.monotonic()
    loaded = snapshot.load(snapshot_dir)
    done = time.monotonic()
    print(json.dumps({"time": time.time(), "python_start_s": python_start_s, "import_s": imported - started,
                      "load_s": done - imported, "since_process_start": _since_process_start(),
                      "bytes": loaded.manifest.total_bytes, "step": loaded.manifest.step}), flush=True)
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("noop", "load"):
        print("usage: python -m ckptrun.cli.recovery_budget.rto_probe (noop READY_DIR | load SNAPSHOT_DIR)", file=sys.stderr)
        return 2
    return noop(Path(argv[1])) if argv[0] == "noop" else load(Path(argv[1]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
