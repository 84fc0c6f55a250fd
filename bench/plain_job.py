"""The default template's job written plainly: the same data, model, optimizer and loop, no ckptrun.

The "without the runtime" side of the template A/B (``runtime_overhead.py``).
It times each step the way the runtime's metrics do (end of one optimizer step
to the end of the next, data loading included) and writes rank 0's list to
--out. Under torchrun it runs as the template does there: DDP over gloo, each
rank its slice of every batch (``DistributedSampler``).

    python bench/plain_job.py --steps 200 --out steps.json
    torchrun --nproc-per-node 2 bench/plain_job.py --steps 200 --out steps.json
"""

import argparse
import json
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

# ----------------------------------------------------------------------------- config
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--weight-decay", type=float, default=0.01)
parser.add_argument("--hidden", type=int, default=640)
parser.add_argument("--dropout", type=float, default=0.1)
parser.add_argument("--samples", type=int, default=1024)
parser.add_argument("--num-workers", type=int, default=2)
parser.add_argument("--max-norm", type=float, default=1.0)
parser.add_argument("--ema-decay", type=float, default=0.99)
parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
parser.add_argument("--deterministic", action="store_true", help="torch.use_deterministic_algorithms, as the runtime's default")
parser.add_argument("--out", required=True, help="JSON file for the per-step times")
args = parser.parse_args()

if args.threads:
    torch.set_num_threads(args.threads)
if args.deterministic:
    torch.use_deterministic_algorithms(True)
distributed = "RANK" in os.environ
if distributed:
    dist.init_process_group("gloo")
rank = dist.get_rank() if distributed else 0
random.seed(rank)
np.random.seed(rank)
torch.manual_seed(rank)


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


data = TeacherData(args.samples)
sampler = torch.utils.data.DistributedSampler(data, shuffle=True, seed=0, drop_last=True) if distributed else None
loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size, shuffle=sampler is None, sampler=sampler,
                                     num_workers=args.num_workers, drop_last=True,
                                     generator=torch.Generator().manual_seed(0))

# ----------------------------------------------------------------------------- model
model = nn.Sequential(
    nn.Linear(64, args.hidden), nn.GELU(), nn.Dropout(args.dropout),
    nn.Linear(args.hidden, args.hidden), nn.GELU(), nn.Dropout(args.dropout),
    nn.Linear(args.hidden, args.hidden), nn.GELU(), nn.Dropout(args.dropout),
    nn.Linear(args.hidden, 10),
)
ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(args.ema_decay))
net = model  # the EMA follows the unwrapped module, as the runtime's does
model = DDP(model) if distributed else model
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, args.steps))

# ----------------------------------------------------------------------------- train
step, epoch, times, last = 0, 0, [], time.monotonic()
while step < args.steps:
    if sampler is not None:
        sampler.set_epoch(epoch)
    epoch += 1
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
        optimizer.step()
        scheduler.step()
        ema.update_parameters(net)
        optimizer.zero_grad(set_to_none=True)
        value = float(loss.detach())
        now = time.monotonic()
        times.append(now - last)
        last = now
        step += 1
        if step % 10 == 0 and rank == 0:
            print(f"step {step:5d}  loss {value:.4f}", flush=True)
        if step >= args.steps:
            break

if rank == 0:
    with open(args.out, "w") as stream:
        json.dump({"step_time_s": times}, stream)
if distributed:
    dist.destroy_process_group()
