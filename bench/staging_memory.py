"""Host staging memory with 2 ranks: each rank stages only its share of the state (DDP and FSDP2).

    python bench/staging_memory.py [--hidden 1024]

Runs the default DDP template and the FSDP2 test job under torchrun (2 CPU
ranks, gloo, async saves) and prints, per rank, the staging bytes the stager
allocated against the whole state, plus rank 0's resident memory right after
staging. Before sharded staging every rank held the whole state (2x per node).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JOBS = {
    "ddp": ["-m", "ckptrun.templates.default_job", "--num-workers", "0", "--steps", "3"],
    "fsdp2": [str(ROOT / "tests" / "fixtures" / "fsdp_job.py"), "--steps", "3"],
}


def measure(name: str, width: int) -> dict:
    from ckptrun.runtime.env import RunEnv
    from ckptrun.runtime.records import read_events

    run_dir = Path(tempfile.mkdtemp(prefix=f"staging-{name}-"))
    args = [*JOBS[name], "--hidden" if name == "ddp" else "--width", str(width)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           **RunEnv(run_id=f"bench-{name}", run_dir=run_dir, save_every_steps=1, async_save=True).to_env()}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *args],
                   env=env, check=True, capture_output=True)
    first = read_events(run_dir, "snapshot_saved")[0]
    return {"job": name, "world_size": 2, "state_bytes": _state_bytes(Path(first["path"])),
            "staged_bytes_per_rank": first["staged_bytes_per_rank"],
            "rank0_rss_after_stage_bytes": first["rss_after_stage_bytes"]}


def _state_bytes(snapshot: Path) -> int:
    manifest = json.loads((snapshot / "manifest.json").read_text())
    sizes = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8}
    total = 0
    for entry in manifest["tensors"].values():
        count = 1
        for dim in entry["shape"]:
            count *= dim
        total += count * sizes.get(entry["dtype"], 4)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024, help="model width (DDP template hidden, FSDP2 job width)")
    width = parser.parse_args().hidden
    for name in JOBS:
        figure = measure(name, width)
        share = [b / figure["state_bytes"] for b in figure["staged_bytes_per_rank"]]
        print(json.dumps({**figure, "share_per_rank": [round(s, 3) for s in share],
                          "staged_per_node_over_state": round(sum(share), 3)}))


if __name__ == "__main__":
    main()
