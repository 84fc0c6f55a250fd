"""The job of the side-by-side restart bench: the default template's ~0.9M-param MLP, logging every step per rank.

One script under all three launchers (``peer_restart.py``): ``ckptrun launch``,
NVIDIA's ``ft_launcher`` and plain ``torchrun``. It uses ``ckptrun.runtime``
either way, so every launcher restarts the same job from the same verified
snapshots: under ``ckptrun launch`` the supervisor verifies the snapshot and
names it; under the peers (``CKPTRUN_*`` set by the bench, ``supervised`` off)
rank 0 verifies the newest one itself and broadcasts its choice. Each rank
appends ``{"rank", "step", "time", "pid"}`` to ``--step-log`` after every
optimizer step: the bench reads kill → first step on both ranks from it, the
same way for every launcher. ``--step-sleep`` paces the steps so that a kill
lands mid-run.

    torchrun --nproc-per-node 2 bench/peer_job.py --steps 40 --step-log steps.jsonl
"""

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ckptrun.runtime as ckr

# ----------------------------------------------------------------------------- config
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--hidden", type=int, default=640)
parser.add_argument("--samples", type=int, default=1024)
parser.add_argument("--num-workers", type=int, default=2)
parser.add_argument("--step-sleep", type=float, default=0.05, help="seconds slept after each step (pacing)")
parser.add_argument("--step-log", required=True, help="JSONL file every rank appends its steps to")
args = parser.parse_args()

run = ckr.init(config={k: v for k, v in vars(args).items() if k != "step_log"})


# ----------------------------------------------------------------------------- data
class TeacherData(torch.utils.data.Dataset):
    """Inputs from a fixed generator, labels from a fixed random 'teacher' network (as in the template)."""

    def __init__(self, samples: int, features: int = 64, classes: int = 10) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.x = torch.randn(samples, features, generator=generator)
        teacher = torch.randn(features, classes, generator=generator)
        self.y = (torch.tanh(self.x) @ teacher).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int):
        return self.x[index], self.y[index]


loader = ckr.DataLoader(TeacherData(args.samples), batch_size=args.batch_size, shuffle=True,
                        num_workers=args.num_workers, seed=run.env.seed)

# ----------------------------------------------------------------------------- model
model = nn.Sequential(nn.Linear(64, args.hidden), nn.GELU(), nn.Linear(args.hidden, args.hidden), nn.GELU(),
                      nn.Linear(args.hidden, args.hidden), nn.GELU(), nn.Linear(args.hidden, 10))
model = DDP(model) if run.world_size > 1 else model
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
run.track(model=model, optimizer=optimizer, loader=loader)
run.restore()

# ----------------------------------------------------------------------------- train
log = os.open(args.step_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)  # one write per line: lines never interleave
for batch in run.batches(loader, steps=args.steps):
    run.train_step([batch], forward=lambda b: model(b[0]), loss=lambda logits, b: F.cross_entropy(logits, b[1]))
    line = {"rank": run.rank, "step": run.step, "time": time.time(), "pid": os.getpid()}
    os.write(log, (json.dumps(line) + "\n").encode())
    time.sleep(args.step_sleep)
os.close(log)
run.finish()
