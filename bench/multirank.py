"""One rank of the 2-rank figures: a multi-file snapshot, and the cost of the per-step shared decisions.

Started twice by ``snapshots.write_w2`` (ranks 0 and 1, gloo on localhost).
Both ranks build the same replicated model + AdamW state and save it with
ckptrun's sync path, once per hash algorithm; DCP spreads the replicated
tensors over one file per rank. Then both time ``collectives.all_reduce_sum``
of four floats, the collective every ``Run.end_step`` makes. Rank 0 prints one
JSON line: the snapshot paths and the per-call medians.

    python bench/multirank.py --rank R --world 2 --port P --bytes N --out DIR --algorithms sha256,blake3
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import build_state, init_world, median_of, save_once

# ----------------------------------------------------------------------------- config
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--rank", type=int, required=True)
parser.add_argument("--world", type=int, default=2)
parser.add_argument("--port", type=int, required=True)
parser.add_argument("--bytes", type=int, required=True, help="model + AdamW state size")
parser.add_argument("--out", type=Path, required=True, help="one checkpoint dir per algorithm is made under it")
parser.add_argument("--algorithms", default="sha256")
parser.add_argument("--repeats", type=int, default=5)
parser.add_argument("--calls", type=int, default=300, help="all_reduce_sum calls per repeat")
args = parser.parse_args()

# ----------------------------------------------------------------------------- snapshots
import torch.distributed as dist
from ckptrun.runtime import collectives
from ckptrun.runtime.storage import store
from ckptrun.runtime.checkpoint.saver import Saver

init_world(args.rank, args.world, args.port)
state = build_state(args.bytes)
paths = {}
for algorithm in args.algorithms.split(","):
    ckpt_dir = args.out / algorithm
    if args.rank == 0:  # one lineage, created before any rank asks for it
        store.ensure_lineage(ckpt_dir, "bench")
    collectives.barrier()
    saver = Saver(ckpt_dir, algorithm, asynchronous=False)
    save_once(saver, state)
    result = saver.collect(wait=True)[-1]
    if not result.ok:
        raise SystemExit(f"rank {args.rank}: save failed: {result.error}")
    paths[algorithm] = str(result.path)
    saver.close()
    del saver

# ----------------------------------------------------------------------------- shared decisions
del state
medians = []
for _ in range(args.repeats):
    collectives.barrier()
    medians.append(median_of(lambda: collectives.all_reduce_sum([1.0, 0.0, 0.0, 0.0]), args.calls))
collectives.barrier()
if args.rank == 0:
    print(json.dumps({"snapshots": paths, "all_reduce_s": medians}), flush=True)
dist.destroy_process_group()
