"""The embedded default job: a ~0.9M-parameter MLP classifier on data it generates itself.

Small enough that 2 CPU ranks run 30 steps in a few seconds, and built to catch
an incomplete restore: dropout (needs every rank's RNG), shuffling and two
loader workers (need the data position), AdamW and a cosine schedule (need
optimizer and scheduler state), an EMA of the weights, optional gradient
accumulation. Run it with ``ckptrun launch`` (no script argument), plain
``torchrun --nproc-per-node 2 -m ckptrun.templates.default_job`` or ``python``.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import ckptrun.runtime as ckr

# ----------------------------------------------------------------------------- config
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=30, help="optimizer steps in total")
parser.add_argument("--batch-size", type=int, default=32, help="per rank, per micro-batch")
parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--weight-decay", type=float, default=0.01)
parser.add_argument("--hidden", type=int, default=640)
parser.add_argument("--dropout", type=float, default=0.1)
parser.add_argument("--samples", type=int, default=1024, help="size of the generated dataset")
parser.add_argument("--num-workers", type=int, default=2)
parser.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping (0: off)")
parser.add_argument("--ema-decay", type=float, default=0.99)
args = parser.parse_args()

run = ckr.init(config=vars(args))  # process group, seeds, determinism, heartbeats


# ----------------------------------------------------------------------------- data
class TeacherData(torch.utils.data.Dataset):
    """Inputs from a fixed generator, labels from a fixed random 'teacher' network."""

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
model = nn.Sequential(
    nn.Linear(64, args.hidden), nn.GELU(), nn.Dropout(args.dropout),
    nn.Linear(args.hidden, args.hidden), nn.GELU(), nn.Dropout(args.dropout),
    nn.Linear(args.hidden, args.hidden), nn.GELU(), nn.Dropout(args.dropout),
    nn.Linear(args.hidden, 10),
)
ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(args.ema_decay))
model = DDP(model) if run.world_size > 1 else model
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, args.steps))

run.track(model=model, optimizer=optimizer, scheduler=scheduler, ema=ema, loader=loader)
run.restore()  # from the snapshot this attempt resumes from, if any
if "lr" in run.changed:  # `ckptrun resume --allow-change lr -- --lr X`: the restored state holds the old rate
    run.set_lr(args.lr)

# ----------------------------------------------------------------------------- train
for micro_batches in run.batches(loader, steps=args.steps, accumulate=args.accumulate):
    micro_batches = micro_batches if args.accumulate > 1 else [micro_batches]
    loss = run.train_step(micro_batches, forward=lambda batch: model(batch[0]),
                          loss=lambda logits, batch: F.cross_entropy(logits, batch[1]), max_norm=args.max_norm or None)
    if run.rank == 0 and run.step % 10 == 0:
        print(f"step {run.step:5d}  loss {loss:.4f}", flush=True)

run.finish()
